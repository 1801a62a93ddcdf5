"""The step's collectives as custom ops, so a compiled step keeps each one as a single node
with its mutation declared, in program order with the launches around it:
``helios::word_exchange`` (the reduction's fixed-width all-gather: reads the send words,
writes the receive words) and ``helios::all_reduce_sum`` (the forward's row-parallel sums:
mutates its tensor in place). The group travels by its registered name
(``ProcessGroup.group_name``); an empty name is one rank (copy through / no-op)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from helios_logprobs.collectives.exchange import all_gather_flat


@torch.library.custom_op("helios::word_exchange", mutates_args=("recv",))
def word_exchange(send: torch.Tensor, recv: torch.Tensor, group_name: str) -> None:
    """All-gather ``send`` [rows, words] int32 of every rank into ``recv``
    [world * rows, words]; an empty group name is a one-rank group (a copy)."""
    if not group_name:
        recv.copy_(send)
        return
    all_gather_flat(recv, send, _resolve_process_group(group_name))


@word_exchange.register_fake
def _(send, recv, group_name) -> None:
    return None


@torch.library.custom_op("helios::all_reduce_sum", mutates_args=("tensor",))
def all_reduce_sum(tensor: torch.Tensor, group_name: str) -> None:
    """Sum ``tensor`` over the group in place (the forward's embedding, attention output and
    MLP down projection at TP > 1); nothing for one rank."""
    if group_name:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_resolve_process_group(group_name))


@all_reduce_sum.register_fake
def _(tensor, group_name) -> None:
    return None


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name the op resolves; '' for no group (one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return ""
    return group.group_name


class TracedExchange:
    """A fixed-width all-gather with WordExchange's ``gather`` interface whose
    communication is ``helios::word_exchange`` (one node of a compiled graph; the receive
    words are a local tensor whose lifetime the compiler plans): the sampler's filters and
    pick (ranks/sampler/filters.py) run through it inside a compiled sample phase."""

    def __init__(self, name: str, world: int) -> None:
        self.group_name = name
        self.world = world

    def gather(self, local: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """[world, rows, words] of every rank's ``local`` [rows, words] int32."""
        if self.world == 1:
            return local.unsqueeze(0)
        n, words = local.shape
        recv = torch.empty(self.world * n, words, dtype=local.dtype, device=local.device)
        word_exchange(local, recv, self.group_name)
        return recv.view(self.world, n, words)
