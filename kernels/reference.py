"""Slow, obviously-correct reference for the packed logprob payload.

Full-vocabulary FP32 log-softmax, then a stable sort by (value descending, id ascending) on
the reported FP32 values. Every other backend is compared with this one.
"""

from __future__ import annotations

import torch

from kernels.layout import CHOSEN_BITS, CHOSEN_ID, FIRST_PAIR, PAYLOAD_WORDS
from kernels.sortkeys import float_bits


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
