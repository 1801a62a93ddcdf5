"""Validation and dispatch for the public reduction entry points."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.layout import EXPORT_K, MAX_TOKEN_IDS, PAYLOAD_WORDS

BACKENDS = ("reference", "torch", "triton")


def pack_token_ids(
    token_ids: Sequence[Sequence[int]] | None, rows: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row caller IDs -> (ids int32 [rows, 128] padded with -1, counts int32 [rows])."""
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    if token_ids is None:
        return ids, counts
    if len(token_ids) != rows:
        raise ValueError(f"token_ids: expected {rows} rows, got {len(token_ids)}")
    for row, row_ids in enumerate(token_ids):
        row_ids = [int(t) for t in row_ids]
        if len(row_ids) > MAX_TOKEN_IDS:
            raise ValueError(f"token_ids[{row}]: at most {MAX_TOKEN_IDS} ids, got {len(row_ids)}")
        if len(set(row_ids)) != len(row_ids):
            raise ValueError(f"token_ids[{row}]: ids must be distinct")
        bad = [t for t in row_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids[{row}]: ids {bad} outside vocabulary [0, {vocab_size})")
        ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        counts[row] = len(row_ids)
    return ids, counts


def check_common(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    k: int,
    vocab_size: int,
    requested: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float [rows, width] tensor, got {logits.shape}")
    rows = logits.shape[0]
    if chosen.shape != (rows,):
        raise ValueError(f"chosen: expected shape ({rows},), got {tuple(chosen.shape)}")
    if not 0 <= k <= EXPORT_K:
        raise ValueError(f"k: expected 0..{EXPORT_K}, got {k}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
    if requested is None:
        requested = torch.ones(rows, dtype=torch.int32, device=logits.device)
    elif requested.shape != (rows,):
        raise ValueError(f"requested: expected shape ({rows},), got {tuple(requested.shape)}")
    if out is None:
        out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32, device=logits.device)
    elif out.shape != (rows, PAYLOAD_WORDS) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(
            f"out: expected contiguous int32 ({rows}, {PAYLOAD_WORDS}), "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return requested, out
