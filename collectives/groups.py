"""Process groups from the torchrun environment, and the tensor collectives the model uses.

Every function takes its group explicitly; a size-1 group (or ``None`` = no group) skips
communication entirely.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    backend: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> Topology:
    """Join the torchrun job (env:// rendezvous). NCCL on CUDA, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            world_size=world,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return Topology(rank=rank, world_size=world, local_rank=local_rank, backend=backend)


def world_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum across the group (row-parallel layers)."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_sum_ordered(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_reduce_sum`` whose every element is added in rank order, so a row's sum has the
    same bits whatever the tensor's size (batch-invariant mode). A ring all-reduce adds each
    chunk starting from a different rank, and chunk boundaries move with the row count."""
    world = group_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total += part
    return tensor.copy_(total)


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate equal-width shards along the last dimension (hidden-size activations only)."""
    world = group_size(group)
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def broadcast_(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place broadcast from group rank ``src``."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    return tensor


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    """Set-up only (shard bounds, endpoints): never on the per-step path."""
    world = group_size(group)
    if world == 1:
        return [obj]
    out: list[object] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
