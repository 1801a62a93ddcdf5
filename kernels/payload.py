"""Packed-payload assembly shared by the torch paths (kernels/cpu/: tiles.py, lean.py,
sharded.py): flagged-row selection, top-K of candidate keys, and the [rows, PAYLOAD_WORDS]
layout of chosen pair + alternative pairs."""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
)
from helios_logprobs.kernels.sortkeys import EMPTY_KEY, float_bits, key_ids, key_values


def flagged_rows(flags: torch.Tensor) -> torch.Tensor | None:
    """int64 indices of the True rows, or None when every row is flagged (slices then)."""
    if bool(flags.all()):
        return None
    return flags.nonzero().flatten()


def top_keys(candidates: torch.Tensor, k: int) -> torch.Tensor:
    """[n, m] int64 keys -> [n, k] best keys, best first (EMPTY_KEY pads when m < k)."""
    n, m = candidates.shape
    best = candidates.topk(min(k, m), dim=1, sorted=True).values
    if best.shape[1] < k:
        pad = torch.full((n, k - best.shape[1]), EMPTY_KEY, dtype=torch.int64, device=best.device)
        best = torch.cat((best, pad), dim=1)
    return best


def assemble_payload(
    chosen: torch.Tensor,
    chosen_values: torch.Tensor,
    natural: torch.Tensor,
    best: torch.Tensor | None,
    picked: torch.Tensor,
    sel: torch.Tensor,
    sel_counts: torch.Tensor,
    sel_values: torch.Tensor,
) -> torch.Tensor:
    """int32 [n, PAYLOAD_WORDS]: chosen id and FP32 bits, then (id, FP32 bits) pairs.

    Rows ``natural`` get the keys ``best`` [len(natural), k], best first (an EMPTY_KEY slot,
    vocabulary < K, gives -1, -1; values are decoded from the keys, so -0.0 reads +0.0).
    Rows ``picked`` get ids ``sel`` [len(picked), 128] with ``sel_values``, in caller order,
    -1 beyond each of ``sel_counts``. Every other word is -1.
    """
    n = chosen.numel()
    payload = torch.full((n, PAYLOAD_WORDS), -1, dtype=torch.int32, device=chosen.device)
    payload[:, CHOSEN_ID] = chosen.to(torch.int32)
    payload[:, CHOSEN_BITS] = float_bits(chosen_values)
    pairs = payload[:, FIRST_PAIR:].view(n, MAX_TOKEN_IDS, 2)
    if best is not None and best.shape[1]:
        k, empty = best.shape[1], best == EMPTY_KEY
        pairs[natural, :k, 0] = torch.where(empty, -1, key_ids(best)).to(torch.int32)
        pairs[natural, :k, 1] = torch.where(empty, -1, float_bits(key_values(best)))
    if picked.numel():
        live = torch.arange(MAX_TOKEN_IDS, device=sel.device) < sel_counts.unsqueeze(1)
        pairs[picked, :, 0] = torch.where(live, sel.to(torch.int32), -1)
        pairs[picked, :, 1] = torch.where(live, float_bits(sel_values), -1)
    return payload


def write_rows(out: torch.Tensor, rows: torch.Tensor | None, payload: torch.Tensor) -> None:
    if rows is None:
        out.copy_(payload)
    else:
        out.index_copy_(0, rows, payload)


def pick_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The flagged rows of a per-row tensor (itself when every row is flagged)."""
    return t if rows is None else t.index_select(0, rows)
