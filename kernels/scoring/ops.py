"""Prompt scoring's three launches as custom ops (``torch.library``), so that a compiled
scoring block (``torch.compile(fullgraph=True)``) treats each as one opaque node, as the
reduction's launches are (kernels/cpu/ops.py).

Each op declares what it writes: ``score_stats`` exchange 1's send words; ``score_candidates``
the block's lse, the targets' reported values and exchange 2's send words; ``score_merge`` the
scored rows. The compiler therefore keeps stats -> gather -> candidates -> gather -> merge in
order, and the fake implementations write nothing and return nothing (every output is a
caller-allocated buffer whose shape the caller fixed).

Launch 1's findings (the chunk maxima and the narrow rows' candidates, kernels/scoring/lean.py)
feed launch 3 on the same shard; they are not exchange words, so they pass from the stats op
to the candidates op through a slot keyed by the logit block's address (the scorer's one
reused block), and the candidates op recomputes them when the slot does not hold that block's.
"""

from __future__ import annotations

import threading

import torch

from helios_logprobs.kernels.scoring import steps
from helios_logprobs.kernels.scoring.lean import ShardScan


class _Scans(threading.local):
    def __init__(self) -> None:
        self.found: dict[tuple[int, int, int], ShardScan | None] = {}


_SCANS = _Scans()


def _key(logits: torch.Tensor) -> tuple[int, int, int]:
    return logits.data_ptr(), logits.shape[0], logits.shape[1]


@torch.library.custom_op("helios::score_stats", mutates_args=("e1_out",))
def score_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                local_valid: int, e1_out: torch.Tensor) -> None:
    """Launch 1 and the target's raw logit -> exchange 1's send words."""
    found = _SCANS.found
    if len(found) > 8:
        found.clear()
    found[_key(logits)] = steps.score_stats(logits, targets, vocab_start, local_valid, e1_out)


@score_stats.register_fake
def _(logits, targets, vocab_start, local_valid, e1_out) -> None:
    return None


@torch.library.custom_op("helios::score_candidates",
                         mutates_args=("lse_out", "value_out", "e2_out"))
def score_candidates(logits: torch.Tensor, targets: torch.Tensor, e1_all: torch.Tensor,
                     shard_starts: list[int], vocab_start: int, local_valid: int,
                     normalize: bool, lse_out: torch.Tensor, value_out: torch.Tensor,
                     e2_out: torch.Tensor) -> None:
    """The global lse and reported values (identical on every rank), then launches 3-4 ->
    exchange 2's send words."""
    key = _key(logits)
    if key in _SCANS.found:
        scan = _SCANS.found.pop(key)
    else:  # (not this block's findings: launch 1 again, into a scratch send row)
        scan = steps.score_stats(logits, targets, vocab_start, local_valid,
                                 torch.empty_like(e2_out))
    lse, value = steps.target_values(e1_all, targets, list(shard_starts), normalize)
    lse_out.copy_(lse)
    value_out.copy_(value)
    steps.score_candidates(logits, scan, lse_out, value_out, vocab_start, local_valid, e2_out)


@score_candidates.register_fake
def _(logits, targets, e1_all, shard_starts, vocab_start, local_valid, normalize, lse_out,
      value_out, e2_out) -> None:
    return None


@torch.library.custom_op("helios::score_merge", mutates_args=("out",))
def score_merge(e2_all: torch.Tensor, targets: torch.Tensor, value: torch.Tensor,
                out: torch.Tensor) -> None:
    """Every shard's words -> the scored rows of ``out``."""
    steps.score_merge(e2_all, targets, value, out)


@score_merge.register_fake
def _(e2_all, targets, value, out) -> None:
    return None
