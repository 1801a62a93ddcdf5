"""A process group shared with a trainer, for pushing new weights into a running server
(vLLM's weight-transfer engine, SGLang's ``init_weights_update_group``: the trainer is rank 0
and hosts the rendezvous store at the master address and port; the server's ranks join as
``rank_offset + tp_rank`` of ``world_size``; each tensor is one broadcast from rank 0).

The backend follows the server ranks' device: NCCL between CUDA devices (each member
broadcasts into its own GPU's memory), gloo over host tensors on the CPU; the server's
coordinator picks it once for every rank (``backend_for``) and a request may name it. It is
a separate group, not the server's own: it is built from its own TCP store, so the trainer
never joins the serving job. A trainer uses ``trainer_init`` and ``trainer_send_weights``;
the ranks use ``join`` and ``receive``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
STORE_PREFIX = "helios-weight-transfer"
BACKENDS = ("nccl", "gloo")


def backend_for(device: torch.device | str) -> str:
    """The group's backend for ranks on ``device``: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_backend(backend: str, device: torch.device | str) -> None:
    """ValueError unless ``backend`` can serve members on ``device`` (NCCL needs CUDA and a
    build with NCCL; gloo moves host tensors from any device)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and (torch.device(device).type != "cuda"
                              or not dist.is_nccl_available()):
        raise ValueError(f"backend 'nccl' needs CUDA devices with NCCL; these ranks are on "
                         f"{torch.device(device).type}: use 'gloo'")


@dataclass(frozen=True)
class TransferGroup:
    """One member's end of the group (the store is kept alive with it). ``device``: where
    broadcast tensors live (its GPU under NCCL, the host under gloo)."""

    store: dist.Store
    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    device: torch.device


def _join(master_address: str, master_port: int, rank: int, world_size: int,
          timeout_s: float, backend: str, device: torch.device | str) -> TransferGroup:
    if not 0 <= rank < world_size:
        raise ValueError(f"weight transfer: rank {rank} is not in a group of {world_size}")
    check_backend(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "nccl":  # (as vLLM's stateless NCCL group builds it)
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        device = torch.device(device)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        with torch.cuda.device(device):
            group = ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        device = torch.device("cpu")
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return TransferGroup(store, group, rank, world_size, backend, device)


def join(master_address: str, master_port: int, rank: int, world_size: int,
         timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
         device: torch.device | str = "cpu") -> TransferGroup:
    """A server rank joins the trainer's group (blocks until every member has joined)."""
    if rank == 0:
        raise ValueError("weight transfer: rank 0 is the trainer's")
    return _join(master_address, master_port, rank, world_size, timeout_s, backend, device)


def trainer_init(master_address: str, master_port: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
                 device: torch.device | str = "cpu") -> TransferGroup:
    """The trainer's end (rank 0, hosting the store on ``master_port``); blocks until the
    server's ranks have joined (POST /init_weight_transfer_engine, sent meanwhile, with the
    same backend: the server's default is ``backend_for`` its ranks' device)."""
    return _join(master_address, master_port, 0, world_size, timeout_s, backend, device)


def _broadcast(member: TransferGroup, tensor: torch.Tensor) -> torch.Tensor:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    member.group.broadcast([tensor], options).wait()
    return tensor


def receive(member: TransferGroup, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The next tensor the trainer sends (on the member's device; under NCCL the work's wait
    orders the current stream after it)."""
    return _broadcast(member, torch.empty(shape, dtype=dtype, device=member.device))


def trainer_send_weights(member: TransferGroup,
                         tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Send every tensor, in the order POST /update_weights names them."""
    for _, tensor in tensors:
        _broadcast(member, tensor.detach().to(member.device).contiguous())
    if member.device.type == "cuda":
        torch.cuda.synchronize(member.device)


def leave(member: TransferGroup | None) -> None:
    """Drop a member's group (best effort: the others may be gone already)."""
    if member is not None:
        shutdown = getattr(member.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass
