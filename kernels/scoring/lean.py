"""Prompt scoring's shard steps on CPU tensors through the reduction's fast launches.

kernels/scoring/steps.py's torch path runs launch 1 (tile_stats), the rank count and the
tiles' candidates slab by slab in tensor ops: ~28 ms for a 64 x 151,936 bf16 block here,
against ~10 ms through these launches. The same three steps exist for generation on the CPU
(kernels/cpu/lean_stats.py, lean.py, compiled.c) with results equal word for word to
the torch ones, so scoring takes them: launch 1 from lean_tile_stats, the shard's best 20
lanes from natural_best (the generation ordering: value desc, id asc, ties made by the
subtraction included, -0.0 as +0.0), the count from count.c. The words exchanged and the
rows written are unchanged (tests/unit/kernels/test_scoring.py compares both paths).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from helios_logprobs.kernels.cpu.compiled import compiled_count_above
from helios_logprobs.kernels.cpu.lean import natural_best
from helios_logprobs.kernels.cpu.lean_stats import Candidates, lean_tile_stats
from helios_logprobs.kernels.cpu.tiles import TILE_LANES, TileStats
from helios_logprobs.kernels.layout import PROMPT_K
from helios_logprobs.kernels.sortkeys import EMPTY_KEY, make_keys


class ShardScan(NamedTuple):
    """Launch 1's statistics of a block's rows (copies: launch 1's own buffers are reused by
    its next call of the same shape on this thread), and the narrow rows' candidates (None
    for rows wide enough to take theirs from the chunk maxima)."""

    stats: TileStats
    picks: Candidates | None


def scan_block(logits: torch.Tensor, local_valid: int) -> ShardScan:
    rows = np.arange(logits.shape[0])
    stats, picks = lean_tile_stats(logits, rows, local_valid, TILE_LANES, select=True)
    return ShardScan(TileStats(*(t.clone() for t in stats)), picks)


def count_above_fast(logits: torch.Tensor, local_valid: int, lse: torch.Tensor,
                     value: torch.Tensor) -> torch.Tensor | None:
    """int64 [n] as steps.count_above, or None where count.c does not apply."""
    counts = compiled_count_above(logits, local_valid, lse.numpy(), value.numpy())
    return None if counts is None else torch.from_numpy(counts)


def best_keys(logits: torch.Tensor, scan: ShardScan, lse: torch.Tensor, vocab_start: int,
              local_valid: int) -> torch.Tensor:
    """int64 [n, 20]: the shard's best 20 sort keys per row (global ids), EMPTY_KEY where the
    shard has fewer lanes (steps.score_candidates empties rows whose lse is not finite)."""
    n = logits.shape[0]
    best, _ = natural_best(logits, np.arange(n), local_valid, scan.stats, scan.picks,
                           np.ascontiguousarray(lse.numpy(), dtype=np.float32), PROMPT_K)
    keys = torch.full((n, PROMPT_K), EMPTY_KEY, dtype=torch.int64)
    ids = torch.from_numpy(best.ids)
    found = make_keys(torch.from_numpy(best.values), ids + vocab_start)
    keys[:, : ids.shape[1]] = torch.where(ids < 0, EMPTY_KEY, found)
    return keys
