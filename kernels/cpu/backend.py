"""The torch reduction's entry point: CPU tensors take the fast path (kernels/cpu/lean.py),
other devices the tile-by-tile launches (kernels/cpu/tiles.py); the same payload bits."""

from __future__ import annotations

import torch

from helios_logprobs.kernels.cpu import lean as torch_lean
from helios_logprobs.kernels.cpu.compiled import RepeatedCall, repeated_call
from helios_logprobs.kernels.cpu.lean_stats import uses_chunks
from helios_logprobs.kernels.cpu.tiles import (
    TILE_LANES,
    count_rows,
    final_merge,
    normalization,
    tile_candidates,
    tile_stats,
)
from helios_logprobs.kernels.payload import flagged_rows, pick_rows, write_rows
from helios_logprobs.kernels.rows import RowRequest


def reduce_torch(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    *,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """The four launches on the flagged rows of a full-vocabulary [rows, width] block."""
    if torch_lean.LEAN and logits.device.type == "cpu":
        return torch_lean.reduce_lean(logits, request, vocab_size, out, tile)
    chosen, ids, counts, k = request.chosen, request.ids, request.counts, request.k
    rows = flagged_rows(request.requested != 0)
    n = count_rows(rows, logits.shape[0])
    if n == 0:
        return out
    stats = tile_stats(logits, rows, vocab_size, tile)
    lse = normalization(stats)
    natural = (pick_rows(counts, rows) == 0).nonzero().flatten()
    candidates = None
    if k > 0 and natural.numel():
        sub = natural if rows is None else rows[natural]
        if natural.numel() == logits.shape[0]:
            sub = None
        cmax, tail = stats.chunk_max, stats.tail_max
        if natural.numel() < n:
            cmax, tail = cmax[natural], tail[natural]
        candidates = tile_candidates(logits, sub, vocab_size, lse[natural], cmax, tail, 0, tile)
    payload = final_merge(logits, rows, chosen, ids, counts, lse, natural, candidates, k)
    write_rows(out, rows, payload)
    return out


def repeated_native_call(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    *,
    tile: int = TILE_LANES,
) -> RepeatedCall | None:
    """The compiled call that reduce_torch_repeated makes over these buffers, for a C caller
    that runs it itself (RepeatedCall.function); None where reduce_torch_repeated would not
    take the compiled launches."""
    if not (torch_lean.LEAN and logits.device.type == "cpu"):
        return None
    narrow = request.k > 0 and not uses_chunks(vocab_size, tile)
    return repeated_call(logits, request, vocab_size, out, tile, narrow)


def reduce_torch_repeated(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    *,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """reduce_torch for a caller that passes the same buffers on every call (the runtime's
    one-rank driver, each step): on CPU the compiled launches with their arguments prepared
    once (kept alive with them); otherwise, or for rows left to Python, reduce_torch."""
    call = repeated_native_call(logits, request, vocab_size, out, tile=tile)
    if call is not None and call():
        return out
    return reduce_torch(logits, request, vocab_size, out, tile=tile)
