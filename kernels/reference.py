"""Slow, obviously-correct reference for the packed logprob payload.

Full-vocabulary FP32 log-softmax, then a stable sort by (value descending, id ascending) on
the reported FP32 values. Every other backend is compared with this one.
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    FIRST_PAIR,
    PAYLOAD_WORDS,
    PROMPT_FIRST_PAIR,
    PROMPT_K,
    PROMPT_RANK,
    PROMPT_ROW_WORDS,
    PROMPT_TARGET_BITS,
    PROMPT_TARGET_ID,
)
from helios_logprobs.kernels.sortkeys import float_bits


def reference_logprobs(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """[rows, width] any float dtype -> FP32 [rows, vocab_size] reported logprobs."""
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    x = logits[:, :vocab].to(torch.float32)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    values = x - lse
    bad = ~torch.isfinite(lse)
    return torch.where(bad, torch.full_like(values, float("nan")), values)


def reference_ranking(values: torch.Tensor) -> torch.Tensor:
    """Ids of one row ordered by (value desc, id asc), -0.0 equal to +0.0."""
    v = torch.where(values == 0, torch.zeros_like(values), values)
    ids = torch.arange(v.numel(), dtype=torch.int64)
    # Stable sort on id first (already ascending), then on value descending.
    order = torch.sort(v, descending=True, stable=True).indices
    return ids[order]


def reduce_reference(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    *,
    k: int,
    token_ids: list[list[int]] | None,
    vocab_size: int | None,
    requested: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    values = reference_logprobs(logits, vocab_size)
    for row in range(logits.shape[0]):
        if requested is not None and int(requested[row]) == 0:
            continue
        out[row].fill_(-1)
        v = values[row]
        c = int(chosen[row])
        out[row, CHOSEN_ID] = c
        out[row, CHOSEN_BITS] = float_bits(v[c : c + 1])[0]
        ids = token_ids[row] if token_ids is not None else []
        if ids:
            picked = torch.tensor(ids, dtype=torch.int64)
            pair_values = v[picked]
        else:
            picked = reference_ranking(v)[:k]
            pair_values = v[picked]
        n = picked.numel()
        pairs = out[row, FIRST_PAIR : FIRST_PAIR + 2 * n].view(n, 2)
        pairs[:, 0] = picked.to(torch.int32)
        pairs[:, 1] = float_bits(pair_values)
        assert out.shape[1] == PAYLOAD_WORDS
    return out


def score_reference(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Scored prompt rows int32 [rows, 43] from full rows: target id, its FP32 logprob bits,
    1 + the number of ids with a strictly greater reported value, then the best 20
    (id, FP32 bits) by (value desc, id asc). Target -1: -1, NaN, 0, pair words -1."""
    values = reference_logprobs(logits, vocab_size)
    rows = logits.shape[0]
    out = torch.full((rows, PROMPT_ROW_WORDS), -1, dtype=torch.int32)
    for row in range(rows):
        t = int(targets[row])
        if t < 0:
            out[row, PROMPT_TARGET_BITS] = float_bits(torch.tensor([float("nan")]))[0]
            out[row, PROMPT_RANK] = 0
            continue
        v = values[row]
        out[row, PROMPT_TARGET_ID] = t
        out[row, PROMPT_TARGET_BITS] = float_bits(v[t : t + 1])[0]
        out[row, PROMPT_RANK] = 1 + int((v > v[t]).sum())
        if torch.isnan(v).any():
            continue  # non-finite normalization: no alternatives
        picked = reference_ranking(v)[:PROMPT_K]
        n = picked.numel()
        pairs = out[row, PROMPT_FIRST_PAIR : PROMPT_FIRST_PAIR + 2 * n].view(n, 2)
        pairs[:, 0] = picked.to(torch.int32)
        pairs[:, 1] = float_bits(v[picked])
    return out
