"""Preallocated fixed-width word exchange: one all-gather of int32 words per row per rank.

FP32 values travel as their bit patterns (int32), so NaN payloads, +-inf and -0.0 arrive
bit-exactly. The output is one flat ``[world * rows, words]`` tensor (gloo and NCCL both
accept this form of all-gather); ``gather`` returns it viewed as ``[world, rows, words]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helios_logprobs.collectives.groups import group_size


class WordExchange:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rows: int,
        words: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if rows < 1 or words < 1:
            raise ValueError(f"WordExchange: rows and words must be >= 1, got {rows}, {words}")
        self.group = group
        self.world = group_size(group)
        self.rows = rows
        self.words = words
        self.send = torch.zeros(rows, words, dtype=torch.int32, device=device)
        self.recv = torch.zeros(self.world * rows, words, dtype=torch.int32, device=device)
        self.bytes_sent = 0
        self.calls = 0

    def gather(self, local: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
        """All-gather ``self.send[:rows]`` (or ``local``, copied into it) from every rank.

        Returns ``[world, rows, words]``; with a size-1 group no communication happens.
        """
        n = self.rows if rows is None else rows
        if local is not None:
            if local.dtype != torch.int32 or local.shape != (n, self.words):
                raise ValueError(
                    f"WordExchange: expected int32 ({n}, {self.words}), "
                    f"got {local.dtype} {tuple(local.shape)}"
                )
            self.send[:n].copy_(local)
        if not torch.compiler.is_compiling():  # (a count dynamo would guard on: recompiles)
            self.calls += 1
        if self.world == 1:
            return self.send[:n].unsqueeze(0)
        self.bytes_sent += n * self.words * 4
        recv = self.recv[: self.world * n] if n == self.rows else self.recv.new_empty(
            (self.world * n, self.words)
        )
        send = self.send[:n]
        all_gather_flat(recv, send, self.group)
        return recv.view(self.world, n, self.words)


def all_gather_flat(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather into one flat tensor under whichever name this torch release prefers."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(recv, send, group=group)
