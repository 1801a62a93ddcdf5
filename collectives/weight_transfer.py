"""A process group shared with a trainer, for pushing new weights into a running server
(vLLM's weight-transfer engine: the trainer is rank 0 and hosts the rendezvous store; the
server's ranks join as ``rank_offset + tp_rank``; each tensor is one broadcast from rank 0).

The group is gloo over CPU tensors on every device (a separate group, not the server's own:
it is built from its own TCP store, so the trainer never joins the serving job). A trainer
uses ``trainer_init`` and ``trainer_send_weights``; the ranks use ``join`` and ``receive``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
STORE_PREFIX = "helios-weight-transfer"


@dataclass(frozen=True)
class TransferGroup:
    """One member's end of the group (the store is kept alive with it)."""

    store: dist.Store
    group: dist.ProcessGroup
    rank: int
    world_size: int


def _join(master_address: str, master_port: int, rank: int, world_size: int,
          timeout_s: float) -> TransferGroup:
    if not 0 <= rank < world_size:
        raise ValueError(f"weight transfer: rank {rank} is not in a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size,
                                  timeout)
    return TransferGroup(store, group, rank, world_size)


def join(master_address: str, master_port: int, rank: int, world_size: int,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> TransferGroup:
    """A server rank joins the trainer's group (blocks until every member has joined)."""
    if rank == 0:
        raise ValueError("weight transfer: rank 0 is the trainer's")
    return _join(master_address, master_port, rank, world_size, timeout_s)


def trainer_init(master_address: str, master_port: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> TransferGroup:
    """The trainer's end (rank 0, hosting the store on ``master_port``); blocks until the
    server's ranks have joined (POST /init_weight_transfer_engine, sent meanwhile)."""
    return _join(master_address, master_port, 0, world_size, timeout_s)


def _broadcast(member: TransferGroup, tensor: torch.Tensor) -> torch.Tensor:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    member.group.broadcast([tensor], options).wait()
    return tensor


def receive(member: TransferGroup, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The next tensor the trainer sends (host memory)."""
    return _broadcast(member, torch.empty(shape, dtype=dtype))


def trainer_send_weights(member: TransferGroup,
                         tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Send every tensor, in the order POST /update_weights names them."""
    for _, tensor in tensors:
        _broadcast(member, tensor.detach().to("cpu").contiguous())


def leave(member: TransferGroup | None) -> None:
    """Drop a member's group (best effort: the others may be gone already)."""
    if member is not None:
        shutdown = getattr(member.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass
