from __future__ import annotations

import pytest
import torch

import kernels.noise.philox_native as native
import ranks.sampler_gumbel as gumbel
from kernels.noise.philox import gumbel_noise
from ranks.sampler import ShardedSampler
from ranks.sampler_filters import score_keys
from ranks.sampler_gumbel import gumbel_best
from ranks.sampling_params import RowSampling

NEG_INF = float("-inf")
KINDS = ["normal", "flat", "ties", "spike", "neg_inf", "wide", "huge", "tiny", "mostly_masked"]


def exhaustive(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, start: int):
    """Every lane's noise: (best key, smallest global id with it) per row."""
    lanes = torch.arange(x.shape[1]) + start
    full = score_keys(x.double() + gumbel_noise(seeds.unsqueeze(1), positions.unsqueeze(1), lanes))
    best = full.max(1).values
    return best, torch.where(full == best.unsqueeze(1), lanes, 2**40).min(1).values


def rows_of(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 3
    if kind == "flat":
        x = torch.zeros(rows, width)
    elif kind == "ties":
        x = torch.round(x)
    elif kind == "spike":
        x[:, 77] += 25
    elif kind == "neg_inf":
        x[torch.rand(rows, width, generator=gen) < 0.5] = NEG_INF
    elif kind == "wide":
        x = x * 12  # a spread near the Gumbel span
    elif kind == "huge":
        x = x + 3e6  # beyond the pruning margins: every lane's noise is evaluated
    elif kind == "tiny":
        x = x * 1e-7
    elif kind == "mostly_masked":
        x[:, 1000:] = NEG_INF
    return x


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setitem(native._STATE, "lib", None)
    elif not native.available():
        pytest.skip("no C compiler")
    return request.param


@pytest.mark.parametrize("kind", KINDS)
def test_dense_rows_pick_the_exhaustive_winner(kind, path):
    width, rows = 17_000, 6
    x = rows_of(kind, rows, width, KINDS.index(kind))
    seeds = torch.tensor([0, -1, 2**62, 77, 5, -(2**63)], dtype=torch.int64)
    positions = torch.tensor([0, 5, 2**32 - 1, 12, 3, 9], dtype=torch.int64)
    got = gumbel_best(x, seeds, positions, vocab_start=300)
    want = exhaustive(x, seeds, positions, 300)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_many_random_rows_with_forced_dense_path(monkeypatch):
    """Small rows through the dense path (threshold lowered), many seeds and spreads."""
    monkeypatch.setattr(gumbel, "ROW_NOISE_MIN_WIDTH", 1)
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        width = int(torch.randint(1, 3000, (1,), generator=gen))
        x = torch.randn(8, width, generator=gen) * float(torch.rand(1, generator=gen) * 20)
        if trial % 3 == 0:
            x = torch.round(x)
        if trial % 4 == 1:
            x[torch.rand(8, width, generator=gen) < 0.3] = NEG_INF
        seeds = torch.randint(-(2**63), 2**63 - 1, (8,), generator=gen)
        positions = torch.randint(0, 2**32, (8,), generator=gen)
        got = gumbel_best(x, seeds, positions, vocab_start=trial * 1000)
        want = exhaustive(x, seeds, positions, trial * 1000)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial


def test_dense_row_tie_picks_the_smallest_id(monkeypatch, path):
    """Equal scores: the winning lane's bits copied to a smaller and a larger lane of a flat
    row (equal noise, equal value) make a three-way tie; the smallest id must win."""
    real = gumbel.philox_bits
    width = 20_000
    first = torch.empty(width, dtype=torch.int64)
    real(torch.arange(width), 8, 4, 0, out=first)
    winner = int(torch.argmax(first))
    assert 100 < winner < width - 1

    def tied_bits(ids, position, k0, k1, out=None, *, clean=False):
        out = real(ids, position, k0, k1, out=out, clean=clean)
        out[100] = out[winner]
        out[width - 1] = out[winner]
        return out

    monkeypatch.setattr(gumbel, "philox_bits", tied_bits)
    key, gid = gumbel_best(torch.zeros(1, width), torch.tensor([4]), torch.tensor([8]), 0)
    assert int(gid[0]) == 100


PARAMS = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_k=1000),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=1.0, min_p=0.02),
    dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
]


@pytest.mark.parametrize("params", PARAMS)
def test_sharded_sampler_tp1_equals_tp4_simulation(params, path):
    """Four shards of 40,000 lanes (local widths >= ROW_NOISE_MIN_WIDTH: the dense path on
    each), combined like pick_global, pick the token TP1 picks, which is the exhaustive one."""
    vocab, n = 40_003, 3
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[1, 123] += 10
    rows = [RowSampling(seed=40 + i, position=7 * i, **params) for i in range(n)]
    prompt = [[1, 2, 3, 500]] * n
    output = [[2, 2, 9, 30_000]] * n
    tp1 = ShardedSampler(None, 0, vocab, vocab, vocab, max_rows=n)
    x = tp1.processed(logits, rows, prompt, output).clone()
    seeds = torch.tensor([r.seed for r in rows])
    positions = torch.tensor([r.position for r in rows])
    want = exhaustive(x, seeds, positions, 0)[1]
    assert torch.equal(tp1.sample(logits, rows, prompt, output), want)
    width = (vocab + 3) // 4
    keys, ids = [], []
    for r in range(4):
        lo, hi = r * width, min(vocab, (r + 1) * width)
        k, i = gumbel_best(x[:, lo:hi].contiguous(), seeds, positions, vocab_start=lo)
        keys.append(k)
        ids.append(i)
    keys, ids = torch.stack(keys), torch.stack(ids)
    best = keys.max(0).values
    assert torch.equal(torch.where(keys == best, ids, 2**40).min(0).values, want)
