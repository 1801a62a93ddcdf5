"""Weight updates broadcast by a trainer (collectives/weight_transfer.py): every rank joins the
trainer's group once (``JoinWeightTransfer``; NCCL into its GPU on CUDA, gloo on the CPU),
then for each update receives every tensor in full, stages its own slices of them in host
memory through the start-up loader (``TensorReader``; a GPU keeps no second copy), and
commits only if every rank staged its shard (ranks/model/weight_update.py: agree, commit).
The coordinator has checked the names, dtypes and shapes against the served checkpoint
before any rank receives anything."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helios_logprobs.collectives import weight_transfer
from helios_logprobs.collectives.codec import message
from helios_logprobs.collectives.groups import group_rank
from helios_logprobs.ranks.model.errors import WeightLoadError
from helios_logprobs.ranks.model.weight_update import agree, commit, stage

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
"""The dtype names an update may send (vLLM's dtype_names: torch's attribute names)."""


@message("ranks.join_weight_transfer")
@dataclass(frozen=True)
class JoinWeightTransfer:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    """NCCL or gloo, picked once by the coordinator (collectives/weight_transfer.py)."""

    def __post_init__(self) -> None:
        if self.backend not in weight_transfer.BACKENDS:
            raise ValueError(f"backend: one of {', '.join(weight_transfer.BACKENDS)}, got "
                             f"{self.backend!r}")
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"master_address: a host, got {self.master_address!r}")
        if type(self.master_port) is not int or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port: a TCP port, got {self.master_port!r}")
        if type(self.rank_offset) is not int or self.rank_offset < 1:
            raise ValueError(f"rank_offset: >= 1 (the trainer is rank 0), got "
                             f"{self.rank_offset!r}")
        if type(self.world_size) is not int or self.world_size <= self.rank_offset:
            raise ValueError(f"world_size: more than rank_offset, got {self.world_size!r}")


@message("ranks.receive_weights")
@dataclass(frozen=True)
class ReceiveWeights:
    """Receive these tensors, in this order, from the trainer; then stage, agree, commit."""

    names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    number: int

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        unknown = [d for d in self.dtype_names if d not in DTYPES]
        if unknown:
            raise ValueError(f"dtype_names: {unknown[0]!r} is not one of {sorted(DTYPES)}")


class TensorReader:
    """CheckpointReader's interface over tensors already in memory (name -> full tensor)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, shape: tuple[int, ...], dim: int = 0, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise WeightLoadError(f"missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(tensor.shape) != tuple(shape):
            raise WeightLoadError(f"tensor {name!r} has shape {list(tensor.shape)}, expected "
                                  f"shape {list(shape)}")
        if length is None:
            return tensor
        return tensor.narrow(dim, start, length)


def join_transfer(model, msg: JoinWeightTransfer) -> str | None:
    """Join the trainer's group as ``rank_offset + tp_rank``; every rank keeps its group only
    if every rank joined. None, or the first failing rank's error."""
    rank = group_rank(model.group)
    weight_transfer.leave(getattr(model, "weight_transfer", None))
    model.weight_transfer, error = None, None
    try:
        member = weight_transfer.join(msg.master_address, msg.master_port,
                                      msg.rank_offset + rank, msg.world_size,
                                      backend=msg.backend, device=model.device)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        member, error = None, f"rank {rank}: {exc}"
    failed = agree(model, error)
    if failed is None:
        model.weight_transfer = member
    else:
        weight_transfer.leave(member)
    return failed


def receive_update(model, msg: ReceiveWeights) -> str | None:
    """Receive every tensor, stage this rank's slices, agree, commit (None: done)."""
    rank = group_rank(model.group)
    member = getattr(model, "weight_transfer", None)
    staged, error = None, None
    try:
        if member is None:
            raise RuntimeError("no weight transfer group (POST /init_weight_transfer_engine)")
        received = {name: weight_transfer.receive(member, tuple(shape), DTYPES[dtype])
                    for name, dtype, shape in zip(msg.names, msg.dtype_names, msg.shapes,
                                                  strict=True)}
        staged = stage(model, None, reader=TensorReader(received))
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"rank {rank}: {exc}"
    failed = agree(model, error)
    if failed is None:
        commit(model, staged)
    return failed
