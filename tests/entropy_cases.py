"""Rows for the entropy tests (unit at TP1, distributed at TP2/TP4) and their float64 oracle."""

from __future__ import annotations

import torch

VOCAB = 301
"""Not divisible by 2 or 4: the last shard is short and its padded lanes are never read."""
PAD_VALUE = 1e30
NEG_INF = float("-inf")
TOLERANCE = 1e-4


def entropy_rows() -> torch.Tensor:
    """[rows, VOCAB] FP32: random scales, -inf lanes (a filter's mask), one kept lane, a
    uniform row, an all-but-two row, NaN lanes (no distribution: NaN) and a peaked row."""
    gen = torch.Generator().manual_seed(38)
    x = torch.randn(12, VOCAB, generator=gen) * torch.tensor(
        [0.1, 1.0, 3.0, 10.0, 30.0, 3.0, 3.0, 1.0, 3.0, 3.0, 1.0, 100.0]).unsqueeze(1)
    x[5, 40:] = NEG_INF  # only the first shard's lanes survive
    x[6] = NEG_INF
    x[6, 200] = 4.0  # one kept lane: entropy 0
    x[7] = 0.25  # uniform: log(VOCAB)
    x[8, ::3] = NEG_INF  # masked lanes on every shard
    x[9] = NEG_INF
    x[9, [3, 299]] = torch.tensor([1.0, 1.5])  # two lanes on the first and the last shard
    x[10, [7, 150, 290]] = float("nan")
    x[11, 120] = 5000.0
    return x


def reference_entropy(x: torch.Tensor) -> torch.Tensor:
    """Float64 entropy in nats of softmax(row): -sum p log p over p > 0 (NaN with a NaN or
    +inf lane)."""
    y = x.to(torch.float64)
    logp = torch.log_softmax(y, dim=-1)
    p = logp.exp()
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    undefined = (y.isnan() | (y == float("inf"))).any(-1)
    return torch.where(undefined, float("nan"), h)


def shard_of(x: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, int, int]:
    """(this rank's [rows, width] logits with PAD_VALUE padding, vocab start, valid lanes)."""
    width = -(-x.shape[1] // world)
    start = rank * width
    valid = max(0, min(width, x.shape[1] - start))
    local = torch.full((x.shape[0], width), PAD_VALUE)
    local[:, :valid] = x[:, start : start + valid]
    return local, start, valid
