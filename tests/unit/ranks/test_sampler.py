from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from helios_logprobs.kernels.noise.philox import gumbel_noise
from helios_logprobs.ranks.sampler.filters import (
    ARGMAX_TILE,
    first_argmax,
    key_values,
    score_keys,
    value_keys,
)
from helios_logprobs.ranks.sampler.gumbel import gumbel_best
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
from tests import sampler_oracle as oracle

NEG_INF = float("-inf")


def make_sampler(vocab: int, rows: int, pad: int = 0) -> ShardedSampler:
    return ShardedSampler(None, 0, vocab, vocab + pad, vocab, rows)


def kept_ids(y: torch.Tensor, r: RowSampling) -> set[int]:
    return set(torch.nonzero(oracle.kept(y, r)).flatten().tolist())


def test_greedy_is_argmax_with_smallest_id_on_ties():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 3, 40]] = 9.0
    logits[2, [44, 45]] = 9.0
    logits[3] = 0.0
    rows = [RowSampling(seed=i, position=0, temperature=0.0, top_k=2, top_p=0.1) for i in range(4)]
    got = make_sampler(50, 4).sample(logits, rows, [[]] * 4, [[]] * 4).tolist()
    assert got == [int(logits[0].argmax()), 3, 44, 0]


@pytest.mark.parametrize("width", [ARGMAX_TILE * 64, 151_936, 32_000, 423])
@pytest.mark.parametrize("rows", [1, 9])
def test_first_argmax_is_torch_argmax(rows, width):
    """Row 0 random; later rows plant the cases the tiled path must get right: the max twice
    (in one tile and in two tiles), at the last lane of a short last tile, -0.0 before +0.0,
    an all -inf row, +inf, and NaN (torch.argmax returns the first NaN)."""
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen)
    cases = [
        (3, [width - 1, width // 2]),
        (2, [ARGMAX_TILE + 5, ARGMAX_TILE + 1]),
        (7, [width - 1]),
    ]
    for row, lanes in cases[: rows - 1]:
        x[row, [lane % width for lane in lanes]] = 50.0
    if rows > 4:
        x[4] = 0.0
        x[4, width // 3] = -0.0
        x[5] = NEG_INF
        x[6, [width - 2, 17]] = float("inf")
        x[7, [width - 3, width // 2]] = float("nan")
        x[8, 1] = float("nan")
    assert torch.equal(first_argmax(x), torch.argmax(x, dim=1))
    assert torch.equal(first_argmax(x[:, 1:]), torch.argmax(x[:, 1:], dim=1))  # strided view


def test_padded_lanes_never_sampled():
    logits = torch.zeros(3, 12)
    logits[:, 10:] = 1e30
    rows = [
        RowSampling(seed=1, position=0, temperature=0.0),
        RowSampling(seed=2, position=0, temperature=5.0),
        RowSampling(seed=3, position=0, top_p=0.5),
    ]
    sampler = make_sampler(10, 3, pad=2)
    for step in range(30):
        rows = [replace(r, position=step) for r in rows]
        assert max(sampler.sample(logits, rows, [[]] * 3, [[]] * 3).tolist()) < 10


def test_penalties_bias_and_allowed_ids_match_reference():
    v = 64
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, v, generator=gen) * 3
    prompt = [[1, 2, 3, 2], [5, 6], [], [9, 10, 11], [60, 61]]
    output = [[3, 3, 7], [5, 5, 5, 20], [30], [], [61, 62, 62, 1]]
    rows = [
        RowSampling(seed=0, position=0, temperature=0.0, repetition_penalty=1.3),
        RowSampling(
            seed=1, position=0, temperature=0.7, frequency_penalty=0.4, presence_penalty=-0.3
        ),
        RowSampling(seed=2, position=0, logit_bias=((30, 5.0), (31, -100.0))),
        RowSampling(seed=3, position=0, temperature=0.0, allowed_token_ids=(9, 40, 41)),
        RowSampling(
            seed=4,
            position=0,
            temperature=2.0,
            repetition_penalty=0.8,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            logit_bias={61: 2.5},
            allowed_token_ids=(1, 61, 62, 63),
        ),
    ]
    before = logits.clone()
    got = make_sampler(v, 5).processed(logits, rows, prompt, output)
    assert torch.equal(logits, before)
    for i, r in enumerate(rows):
        expected = oracle.scaled(oracle.processed(logits[i], r, prompt[i], output[i]), r)
        assert torch.equal(got[i], expected), i
    greedy = make_sampler(v, 5).sample(logits, rows, prompt, output)
    assert int(greedy[3]) == int(oracle.processed(logits[3], rows[3], [], []).argmax())
    assert int(greedy[3]) in (9, 40, 41)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("shard", [(0, 301), (100, 150)])
def test_penalties_of_a_batch_change_only_their_own_rows(shard, shared):
    """The penalties run batched over the rows: every row, penalized or not, equals the
    oracle's row, on a whole vocabulary and on a shard of it (ids on other shards ignored).
    Row 0 has no penalty and a finite logit past what a penalty would leave (LOGIT_LIMIT)
    on an id every output repeats, row 3 (presence only) one on an id only its prompt holds:
    both must keep them."""
    v, n = 301, 9
    start, width = shard
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(n, v, generator=gen) * 3
    logits[0, 120] = 1e36
    logits[3, 200] = 1e36
    combos = [dict(), dict(repetition_penalty=1.3), dict(frequency_penalty=0.7),
              dict(presence_penalty=-0.4), dict(repetition_penalty=0.6, presence_penalty=1.5),
              dict(frequency_penalty=-0.3, presence_penalty=0.2),
              dict(repetition_penalty=1.05, frequency_penalty=0.5, presence_penalty=0.5),
              dict(repetition_penalty=1.2, temperature=0.0), dict()]
    if shared:  # (every penalized row with the same values: one float32 per penalty)
        combos = [{k: {"repetition_penalty": 1.3, "frequency_penalty": 0.7,
                       "presence_penalty": -0.4}.get(k, v) for k, v in c.items()}
                  for c in combos]
    rows = [RowSampling(seed=i, position=3, **({"temperature": 0.9} | c))
            for i, c in enumerate(combos)]
    prompt = [torch.randint(v, (int(torch.randint(0, 40, (1,), generator=gen)),),
                            generator=gen).tolist() + [120, 200] for _ in range(n)]
    output = [torch.randint(v, (int(torch.randint(0, 30, (1,), generator=gen)),),
                            generator=gen).tolist() + [120, 120, 7] for _ in range(n)]
    output[3] = [t for t in output[3] if t != 200]
    sampler = ShardedSampler(None, start, width, width, v, n)
    got = sampler.processed(logits[:, start : start + width].contiguous(), rows, prompt, output)
    for i, r in enumerate(rows):
        want = oracle.scaled(oracle.processed(logits[i], r, prompt[i], output[i]), r)
        assert torch.equal(got[i], want[start : start + width]), (i, combos[i])
    assert min(float(got[0, 120 - start]), float(got[3, 200 - start])) > 1e35  # (not clamped)


def test_repetition_penalty_scales_the_biased_logit():
    """vLLM adds logit_bias before the penalties: (x + b) / p, not x / p + b."""
    logits = torch.full((2, 8), -1.0)
    logits[0, [2, 5]] = torch.tensor([2.0, 2.5])  # 2: (2 + 2) / 2 = 2.0 < 2.5 (not 3.0)
    logits[1, [3, 6]] = torch.tensor([-2.0, 0.0])  # 3: (-2 + 3) / 2 = 0.5 > 0 (not -1.0)
    rows = [
        RowSampling(
            seed=0, position=0, temperature=0.0, repetition_penalty=2.0, logit_bias={2: 2.0}
        ),
        RowSampling(
            seed=0, position=0, temperature=0.0, repetition_penalty=2.0, logit_bias={3: 3.0}
        ),
    ]
    prompt, output = [[2, 7], [1]], [[7], [3, 3]]
    sampler = make_sampler(8, 2)
    got = sampler.processed(logits, rows, prompt, output)
    assert got[0, 2] == 2.0 and got[1, 3] == 0.5
    for i, r in enumerate(rows):
        assert torch.equal(got[i], oracle.final(logits[i], r, prompt[i], output[i]))
    assert sampler.sample(logits, rows, prompt, output).tolist() == [5, 3]


def test_top_p_measures_mass_after_min_p():
    """vLLM runs min-p before top-k/top-p, so top-p renormalises over what min-p kept."""
    perm = [3, 0, 4, 1, 2]
    logits_row = torch.empty(5)
    logits_row[perm] = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]).log()
    params = dict(min_p=0.15, top_p=0.85)
    r = RowSampling(seed=0, position=0, **params)
    # min-p drops the two 0.05s; of the remaining 0.9, 0.8 / 0.9 >= 0.85 lies above the 0.1,
    # so top-p drops it too (top-p first would keep it: 0.8 < 0.85).
    assert kept_ids(logits_row, r) == {3, 0}
    got = make_sampler(5, 1).processed(logits_row.unsqueeze(0), [r], [[]], [[]])
    assert torch.nonzero(got[0] > NEG_INF).flatten().tolist() == [0, 3]
    counts = sample_many(logits_row, params, 500)
    assert set(counts) == {0, 3}


def test_min_p_uses_temperature_scaled_probabilities():
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    r = RowSampling(seed=0, position=0, temperature=2.0, min_p=0.3)
    got = make_sampler(4, 1).processed(logits, [r], [[]], [[]])
    # exp(-1 / 2) = 0.61 and exp(-2 / 2) = 0.37 pass 0.3; unscaled, exp(-2) = 0.14 would not.
    assert torch.nonzero(got[0] > NEG_INF).flatten().tolist() == [0, 1, 2]


ORDER_ROWS = [
    dict(temperature=0.0, repetition_penalty=1.7, logit_bias={4: 1.5, 9: -0.5, 200: 2.0}),
    dict(temperature=0.9, repetition_penalty=1.4, logit_bias={4: 2.0, 17: 3.0, 250: -1.0}),
    dict(temperature=0.7, repetition_penalty=0.7, frequency_penalty=0.3, logit_bias={9: 1.0}),
    dict(min_p=0.05, top_p=0.7, temperature=1.3),
    dict(min_p=0.2, top_p=0.95, top_k=20),
    dict(top_k=280, top_p=0.6, min_p=0.02, temperature=2.0),
    dict(
        allowed_token_ids=tuple(range(0, 300, 7)),
        logit_bias={7: 2.0, 14: -3.0},
        repetition_penalty=1.3,
        presence_penalty=0.4,
        top_p=0.8,
        temperature=1.5,
    ),
    dict(
        temperature=0.0,
        allowed_token_ids=(4, 9, 17, 200),
        repetition_penalty=3.0,
        logit_bias={4: 4.0},
    ),
    dict(temperature=0.0, bad_words=((4, 17), (17, 17, 9), (200,)), logit_bias={17: 2.0}),
    dict(temperature=0.8, min_tokens=2, min_tokens_ids=(4, 9), bad_words=((17, 4),),
         top_p=0.9, repetition_penalty=1.2),
]


@pytest.mark.parametrize("step", range(4))
def test_sampled_tokens_match_the_oracle(step):
    v, pad = 300, 4
    gen = torch.Generator().manual_seed(50 + step)
    logits = torch.randn(len(ORDER_ROWS), v + pad, generator=gen) * 2.5
    logits[:, [4, 9, 17, 200]] += 3.0
    rows = [RowSampling(seed=31 * i + 2, position=step, **p) for i, p in enumerate(ORDER_ROWS)]
    prompt = [[4, 9, 17, 200, (11 * i) % v] for i in range(len(rows))]
    output = [[4, 17, 17, (23 * i + step) % v][: step + 1] for i in range(len(rows))]
    sampler = make_sampler(v, len(rows), pad=pad)
    tokens = sampler.sample(logits, rows, prompt, output).tolist()
    expected = [oracle.sample(logits[i, :v], r, prompt[i], output[i]) for i, r in enumerate(rows)]
    assert tokens == expected
    got = sampler.processed(logits, rows, prompt, output)
    for i, r in enumerate(rows):
        assert torch.equal(got[i], oracle.final(logits[i, :v], r, prompt[i], output[i])), i


FILTER_ROWS = [
    dict(top_k=7),
    dict(top_k=1),
    dict(top_k=300),
    dict(top_k=700, temperature=0.5),
    dict(top_p=0.9),
    dict(top_p=0.25, temperature=1.7),
    dict(min_p=0.1),
    dict(top_k=40, top_p=0.8, min_p=0.02, temperature=0.8),
    dict(top_k=400, top_p=0.5, temperature=0.6),
    dict(top_k=1000),
]


@pytest.mark.parametrize(("seed", "shift"), [(0, 0.0), (1, -60.0)])
def test_filters_keep_exactly_the_expected_set(seed, shift):
    v = 1000
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(FILTER_ROWS), v, generator=gen) * 2 + shift
    rows = [RowSampling(seed=i, position=0, **p) for i, p in enumerate(FILTER_ROWS)]
    got = make_sampler(v, len(rows)).processed(logits, rows, [[]] * len(rows), [[]] * len(rows))
    for i, r in enumerate(rows):
        y = logits[i] / torch.tensor(r.temperature, dtype=torch.float32)
        kept = set(torch.nonzero(got[i] > NEG_INF).flatten().tolist())
        assert kept == kept_ids(y, r), FILTER_ROWS[i]
        assert torch.equal(got[i][got[i] > NEG_INF], y[got[i] > NEG_INF])


def test_ties_at_thresholds_are_kept_whole():
    logits = torch.tensor([[5.0, 4.0, 3.0, 4.0, 1.0, 4.0, 0.0, 0.0]] * 3)
    logits[2] = torch.tensor([2.0, 1.0, 0.0, 1.0, -1.0, -5.0, -5.0, -5.0])
    rows = [
        RowSampling(seed=0, position=0, top_k=2),
        RowSampling(seed=0, position=0, top_k=300),
        RowSampling(seed=0, position=0, top_p=0.75),
    ]
    got = make_sampler(8, 3).processed(logits, rows, [[]] * 3, [[]] * 3)
    assert torch.nonzero(got[0] > NEG_INF).flatten().tolist() == [0, 1, 3, 5]
    assert torch.equal(got[1], logits[1])
    # mass of {2.0} = 0.47 < 0.75, so the tied pair at 1.0 stays whole.
    assert torch.nonzero(got[2] > NEG_INF).flatten().tolist() == [0, 1, 3]


def sample_many(logits_row, params, draws, batch=250):
    v = logits_row.numel()
    sampler = make_sampler(v, batch)
    counts: Counter[int] = Counter()
    for start in range(0, draws, batch):
        rows = [RowSampling(seed=s, position=3, **params) for s in range(start, start + batch)]
        logits = logits_row.expand(batch, -1).contiguous()
        counts.update(sampler.sample(logits, rows, [[]] * batch, [[]] * batch).tolist())
    return counts


@pytest.mark.parametrize(
    "params",
    [dict(top_k=7, temperature=3.0), dict(top_p=0.6), dict(min_p=0.2, temperature=0.9)],
)
def test_sampled_ids_cover_exactly_the_kept_set(params):
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(3))
    logits_row = torch.empty(50)
    logits_row[perm] = -0.3 * torch.arange(50, dtype=torch.float32)
    r = RowSampling(seed=0, position=0, **params)
    expected = kept_ids(oracle.scaled(logits_row, r), r)
    assert 4 <= len(expected) <= 10
    counts = sample_many(logits_row, params, 2000)
    assert set(counts) == expected


@pytest.mark.parametrize(
    ("params", "kept"), [(dict(temperature=0.7), 8), (dict(temperature=1.3, top_k=5), 5)]
)
def test_empirical_distribution_matches_softmax(params, kept):
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, -0.6])
    draws = 5000
    counts = sample_many(logits_row, params, draws)
    y = logits_row.double() / params["temperature"]
    y[torch.argsort(y, descending=True)[kept:]] = NEG_INF
    probs = torch.softmax(y, 0)
    chi2 = sum(
        (counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs.tolist()) if p > 0
    )
    assert set(counts) == {i for i, p in enumerate(probs.tolist()) if p > 0}
    assert chi2 < 40.0, chi2  # df <= 7: p-value ~1e-6


def test_logits_unchanged_bit_exact():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5))
    logits[0, 3] = float("nan")
    logits[1, 4] = float("inf")
    logits[2, 5] = -0.0
    logits[:, 36:] = 7.0
    bits = logits.view(torch.int32).clone()
    rows = [
        RowSampling(seed=1, position=0, temperature=0.0, repetition_penalty=1.5),
        RowSampling(seed=2, position=0, top_k=3, logit_bias={1: 3.0}),
        RowSampling(seed=3, position=0, top_p=0.5, min_p=0.1, frequency_penalty=1.0),
        RowSampling(seed=4, position=0, allowed_token_ids=(0, 1)),
    ]
    out = make_sampler(36, 4, pad=4).sample(logits, rows, [[1, 2]] * 4, [[2, 3, 3]] * 4)
    assert torch.equal(logits.view(torch.int32), bits)
    assert int(out[1]) == 4 and int(out[3]) in (0, 1)


def test_seeded_determinism_and_batch_independence():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(6))
    rows = [RowSampling(seed=s, position=p, top_p=0.95) for s, p in [(10, 0), (11, 0), (10, 1)]]
    sampler = make_sampler(100, 3)
    first = sampler.sample(logits, rows, [[]] * 3, [[]] * 3)
    assert torch.equal(sampler.sample(logits, rows, [[]] * 3, [[]] * 3), first)
    alone = make_sampler(100, 1).sample(logits[2:], rows[2:], [[]], [[]])
    assert int(alone[0]) == int(first[2])
    draws = [
        int(sampler.sample(logits[:1], [RowSampling(seed=10, position=p)], [[]], [[]])[0])
        for p in range(20)
    ]
    assert len(set(draws)) > 5


def test_half_precision_logits_sample_as_their_float32_values():
    """bf16 logits (converted into the FP32 scratch) pick what the same values in FP32 pick;
    a NaN lane counts as -inf in both."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(9)) * 3)
    logits[:, 7] = float("nan")
    logits[2, 11] = 40.0
    half = logits.to(torch.bfloat16)
    rows = [RowSampling(seed=i, position=3, temperature=t)
            for i, t in enumerate((0.0, 0.9, 1.0, 0.0))]
    sampler = make_sampler(300, 4)
    got = sampler.sample(half, rows, [[]] * 4, [[]] * 4).tolist()
    assert got == sampler.sample(half.float(), rows, [[]] * 4, [[]] * 4).tolist()
    assert 7 not in got and got[2] == 11


def test_a_mixed_batch_picks_what_each_row_picks_alone():
    """Greedy and seeded rows in one batch (each kind drawn from its rows) against every row
    sampled alone (one kind: the whole batch at once), wide enough for the dense path."""
    width = 20_000
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(8)) * 3
    rows = [RowSampling(seed=3, position=1, temperature=0.0),
            RowSampling(seed=4, position=9, temperature=0.8),
            RowSampling(seed=5, position=2, temperature=1.3),
            RowSampling(seed=6, position=0, temperature=0.0),
            RowSampling(seed=2**64 - 1, position=7, temperature=1.0)]
    mixed = make_sampler(width, 5).sample(logits, rows, [[]] * 5, [[]] * 5).tolist()
    alone = [int(make_sampler(width, 1).sample(logits[i:i + 1], rows[i:i + 1], [[]], [[]])[0])
             for i in range(5)]
    assert mixed == alone
    assert [mixed[0], mixed[3]] == logits[[0, 3]].argmax(dim=1).tolist()


@pytest.mark.parametrize(("rows", "width"), [(64, 300), (6, 20_000)])
def test_gumbel_pruning_never_changes_the_winner(rows, width):
    gen = torch.Generator().manual_seed(7)
    scale = torch.tensor([40.0, 3.0, 0.0]).repeat(rows // 3 + 1)[:rows].unsqueeze(1)
    x = torch.randn(rows, width, generator=gen) * scale
    x[::5, 17] = float("inf")
    x[4::7] = NEG_INF
    seeds = torch.arange(rows, dtype=torch.int64) - 32
    positions = torch.arange(rows, dtype=torch.int64) * 3
    keys, ids = gumbel_best(x, seeds, positions, vocab_start=1000)
    lanes = torch.arange(width) + 1000
    noise = gumbel_noise(seeds.unsqueeze(1), positions.unsqueeze(1), lanes)
    full = score_keys(x.double() + noise)
    best = full.max(1).values
    brute = torch.where(full == best.unsqueeze(1), lanes, 2**40).min(1).values
    assert torch.equal(keys, best) and torch.equal(ids, brute)


def test_all_masked_row_is_deterministic():
    logits = torch.full((2, 10), NEG_INF)
    rows = [RowSampling(seed=1, position=0), RowSampling(seed=2, position=0, top_p=0.3)]
    assert make_sampler(10, 2).sample(logits, rows, [[]] * 2, [[]] * 2).tolist() == [0, 0]


def test_value_keys_round_trip():
    vals = torch.tensor([NEG_INF, -1.5, -0.0, 0.0, 2.0, float("inf")])
    keys = value_keys(vals)
    assert torch.all(keys[1:] >= keys[:-1]) and int(keys[2]) == int(keys[3])
    assert torch.equal(key_values(keys), vals.abs().where(vals == 0, vals))


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(temperature=math.nan),
        dict(top_k=-2),
        dict(top_p=0.0),
        dict(min_p=1.5),
        dict(repetition_penalty=0.0),
        dict(logit_bias=((1, 1.0), (1, 2.0))),
        dict(allowed_token_ids=()),
        dict(seed=2**64),
        dict(position=-1),
        dict(seed=True),
    ],
)
def test_row_sampling_validation(bad):
    args = dict(seed=0, position=0) | bad
    with pytest.raises(ValueError):
        RowSampling(**args)


def test_sampler_rejects_out_of_vocabulary_ids_and_shapes():
    sampler = make_sampler(10, 2)
    logits = torch.zeros(1, 10)
    with pytest.raises(ValueError):
        sampler.sample(logits, [RowSampling(seed=0, position=0, logit_bias={10: 1.0})], [[]], [[]])
    with pytest.raises(ValueError):
        sampler.sample(
            logits, [RowSampling(seed=0, position=0, presence_penalty=1.0)], [[]], [[10]]
        )
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, 11), [RowSampling(seed=0, position=0)], [[]], [[]])


# Regression pin: tokens the sampler drew before Philox was vectorized and the Gumbel-max
# learned to evaluate the noise only where it can decide (computed with that implementation;
# test_philox.py checks the noise itself against an independent scalar Philox). Rows are
# seeds x positions below; vocabularies of 50 and 1,031 take the flat per-lane path,
# 32,000 and 151,936 the dense row path.
PIN_SEEDS = (0, 12345, 2**63 + 5, -7)
PIN_POSITIONS = (0, 1, 4097, 2**32 - 1)
PINNED = {
    (50, 0.8): [16, 33, 26, 20, 3, 41, 26, 40, 7, 33, 29, 35, 2, 12, 1, 3],
    (50, 1.7): [16, 33, 17, 20, 3, 41, 26, 40, 7, 33, 29, 14, 34, 8, 20, 3],
    (1031, 0.8): [343, 656, 770, 370, 67, 88, 496, 602, 981, 516, 3, 437, 376, 462, 425, 74],
    (1031, 1.7): [902, 656, 355, 424, 175, 88, 538, 388, 189, 893, 625, 437, 324, 345, 341,
                  74],
    (32000, 0.8): [10666, 29259, 3136, 8537, 12761, 19694, 5264, 10384, 27790, 23735, 23743,
                   24658, 3922, 14714, 23242, 10781],
    (32000, 1.7): [1417, 21596, 3136, 9228, 1095, 13580, 22383, 16869, 12807, 9431, 22547,
                   21047, 8123, 18559, 23242, 9430],
    (151936, 0.8): [81795, 31667, 111223, 87238, 76511, 45220, 67379, 136124, 120528, 58806,
                    105897, 80629, 7554, 127680, 68225, 74579],
    (151936, 1.7): [81795, 58534, 52425, 63818, 175, 45220, 22383, 136124, 120528, 37343,
                    134196, 128750, 47934, 112403, 39745, 106804],
}


def pin_logits(vocab: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[0, vocab // 3] += 12.0  # one spiked row
    if rows > 2:
        x[2] = torch.round(x[2])  # many exact ties
    return x


@pytest.mark.parametrize(("vocab", "temperature"), sorted(PINNED))
def test_seeded_tokens_are_pinned(vocab, temperature):
    rows = [
        RowSampling(seed=s, position=p, temperature=temperature)
        for s in PIN_SEEDS
        for p in PIN_POSITIONS
    ]
    n = len(rows)
    got = make_sampler(vocab, n).sample(pin_logits(vocab, n, vocab), rows, [[]] * n, [[]] * n)
    assert got.tolist() == PINNED[(vocab, temperature)]


def test_filtered_rows_tokens_are_pinned():
    rows = [
        RowSampling(seed=9, position=3, temperature=0.9, top_k=40),
        RowSampling(seed=10, position=4, temperature=1.1, top_p=0.8),
        RowSampling(seed=11, position=5, temperature=1.0, min_p=0.05),
        RowSampling(seed=12, position=6, temperature=1.3, top_k=1000, top_p=0.95),
    ]
    got = make_sampler(32000, 4).sample(pin_logits(32000, 4, 7), rows, [[]] * 4, [[]] * 4)
    assert got.tolist() == [612, 13805, 22720, 4780]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_min_tokens_masks_the_stop_ids_until_its_position(temperature):
    """Before min_tokens the request's stop ids cannot be sampled, as if allowed_token_ids
    excluded them (both are -inf masks ahead of logit_bias); from min_tokens on, nothing."""
    vocab = 300
    logits = pin_logits(vocab, 4, 3)
    top = logits.argmax(1).tolist()
    sampler = make_sampler(vocab, 4)

    def rows(position: int, extra) -> list[RowSampling]:
        return [RowSampling(seed=5 + i, position=position, temperature=temperature, **extra(i))
                for i in range(4)]

    def blocked(i):
        return {"min_tokens": 2, "min_tokens_ids": (top[i], 7)}

    def allowed(i):
        return {"allowed_token_ids": tuple(t for t in range(vocab) if t not in (top[i], 7))}

    def none(_):
        return {}

    history = [[]] * 4
    for position in (0, 1):
        got = sampler.sample(logits, rows(position, extra=blocked), history, history).tolist()
        same = sampler.sample(logits, rows(position, extra=allowed), history, history).tolist()
        assert got == same and all(g != t and g != 7 for g, t in zip(got, top, strict=True))
    late = sampler.sample(logits, rows(2, extra=blocked), history, history).tolist()
    assert late == sampler.sample(logits, rows(2, extra=none), history, history).tolist()
    if temperature == 0.0:
        assert late == top


def test_bad_words_mask_the_id_that_would_complete_a_word():
    """A one-id word is never sampled; a longer word's last id only after its prefix, in the
    output (not the prompt). Same tokens as the row under the equivalent allowed_token_ids."""
    vocab = 300
    logits = pin_logits(vocab, 3, 5)
    top = logits.argmax(1).tolist()
    sampler = make_sampler(vocab, 3)
    words = ((top[0],), (11, 12, top[1]), (13, top[2]))
    histories = [[4, 5], [9, 11, 12], [13, 14]]  # row 1 ends with word 2's prefix; row 2 not
    rows = [RowSampling(seed=1 + i, position=3, temperature=0.0, bad_words=words)
            for i in range(3)]
    assert [r.banned_ids(h) for r, h in zip(rows, histories, strict=True)] == [
        [top[0]], [top[0], top[1]], [top[0]]]
    got = sampler.sample(logits, rows, [[13]] * 3, histories).tolist()
    expect = []
    for i, h in enumerate(histories):
        banned = set(rows[i].banned_ids(h))
        row = RowSampling(seed=1 + i, position=3, temperature=0.0,
                          allowed_token_ids=tuple(t for t in range(vocab) if t not in banned))
        expect.append(int(sampler.sample(logits[i : i + 1], [row], [[13]], [h])[0]))
    assert got == expect and got[2] == top[2] and got[0] != top[0] and got[1] != top[1]
