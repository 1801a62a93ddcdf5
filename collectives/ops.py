"""The fixed-width word exchange as a custom op (``helios::word_exchange``), so a compiled
step keeps each all-gather as one node that reads the send words and writes the receive
words (declared), in program order with the launches around it. The group travels by its
registered name (``ProcessGroup.group_name``); one rank copies the words through."""

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


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name the op resolves; '' for no group (one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return ""
    return group.group_name
