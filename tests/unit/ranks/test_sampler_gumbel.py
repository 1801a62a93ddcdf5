from __future__ import annotations

import pytest
import torch

import helios_logprobs.kernels.noise.philox_native as native
import helios_logprobs.ranks.sampler.gumbel as gumbel
from helios_logprobs.kernels.noise.philox import (
    gumbel_bounds,
    gumbel_noise,
    philox_bits,
    seed_words,
)
from helios_logprobs.ranks.sampler.filters import score_keys
from helios_logprobs.ranks.sampler.gumbel import gumbel_best
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

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
    row (equal noise, equal value) make a three-way tie; the smallest id must win. The torch
    path draws the copies through philox_bits; the native path gets them as candidates."""
    width = 20_000
    first = torch.empty(width, dtype=torch.int64)
    gumbel.philox_bits(torch.arange(width), 8, 4, 0, out=first)
    winner = int(torch.argmax(first))
    assert 100 < winner < width - 1
    if path == "torch":
        real_bits = gumbel.philox_bits

        def tied_bits(ids, position, k0, k1, out=None, *, clean=False):
            out = real_bits(ids, position, k0, k1, out=out, clean=clean)
            out[100] = out[winner]
            out[width - 1] = out[winner]
            return out

        monkeypatch.setattr(gumbel, "philox_bits", tied_bits)
    else:
        real_search = gumbel.native_candidates

        def tied_candidates(*args):
            left, owners, lanes, bits, values = real_search(*args)
            assert winner in lanes.tolist()
            copies = torch.tensor([width - 1, 100])
            return native.Candidates(left, owners + [0, 0], torch.cat((lanes, copies)),
                                     torch.cat((bits, first[[winner, winner]])),
                                     torch.cat((values, torch.zeros(2))))

        monkeypatch.setattr(gumbel, "native_candidates", tied_candidates)
    key, gid = gumbel_best(torch.zeros(1, width), torch.tensor([4]), torch.tensor([8]), 0)
    assert int(gid[0]) == 100


needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler")


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [130, 40_001])
def test_native_candidates_hold_the_winner_with_its_bits_at_any_thread_count(kind, width):
    """The compiled search keeps every row's exhaustive winner, hands back each candidate's
    own bits, and finds the same lanes whether a row is one job or split over 2 or 4 (odd
    widths: a partial last block; 130 lanes: more threads than blocks)."""
    rows = 3
    x = rows_of(kind, rows, width, 50 + KINDS.index(kind))
    if kind == "huge":
        x = x - 3e6 + 9e5  # (rows beyond the margins' limit never reach the search)
    seeds, positions = [3, -(2**63), 2**62 + 1], [1, 2**32 - 1, 40]
    want = exhaustive(x, torch.tensor(seeds), torch.tensor(positions), 5)[1]
    found = {}
    for threads in (1, 6, 13):
        left, owners, lanes, bits, values = native.native_candidates(
            x, [0, 1, 2], seeds, positions, 5, gumbel.BOUND_OFFSET, gumbel.BOUND_SCALE,
            gumbel.DENSE_X_LIMIT, threads)
        assert left == []
        found[threads] = (owners, lanes.tolist(), bits.tolist())
        for row in range(rows):
            assert int(want[row]) - 5 in [lane for o, lane in zip(owners, lanes.tolist(),
                                                                  strict=True) if o == row]
        for owner, lane, m in zip(owners, lanes.tolist(), bits.tolist(), strict=True):
            k0, k1 = seed_words(seeds[owner])
            assert m == int(philox_bits(torch.tensor([lane + 5]), positions[owner], k0, k1)[0])
        assert torch.equal(values, x[torch.tensor(owners, dtype=torch.int64), lanes])
    assert found[1] == found[6] == found[13]


@needs_native
def test_rows_over_the_candidate_cap_take_the_row_path(monkeypatch):
    """A row whose values cancel its lanes' noise bounds (every bound equal) makes every lane
    a candidate: the search hands it back, and dense_row_best still finds the exhaustive
    winner; the ordinary row beside it is searched."""
    real_search, handed_back = gumbel.native_candidates, []

    def recording(*args):
        result = real_search(*args)
        handed_back.extend(result[0])
        return result

    monkeypatch.setattr(gumbel, "native_candidates", recording)
    width, seeds, positions = 17_000, torch.tensor([1, 2]), torch.tensor([9, 8])
    k0, k1 = seed_words(1)
    x = rows_of("normal", 2, width, 3)
    x[0] = -gumbel_bounds(philox_bits(torch.arange(width), 9, k0, k1))
    got = gumbel_best(x, seeds, positions, vocab_start=0)
    want = exhaustive(x, seeds, positions, 0)
    assert handed_back == [0]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


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


RAW_KINDS = [*KINDS, "nan", "pos_inf", "all_nan"]


def raw_rows(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    """Raw logits as a model may hand them over: NaN and +inf lanes too."""
    if kind not in ("nan", "pos_inf", "all_nan"):
        return rows_of(kind, rows, width, seed)
    x = rows_of("normal", rows, width, seed)
    gen = torch.Generator().manual_seed(seed)
    if kind == "nan":
        x[torch.rand(rows, width, generator=gen) < 0.4] = float("nan")
    elif kind == "pos_inf":
        x[0, 33] = float("inf")
    else:
        x[1] = float("nan")
    return x


@pytest.mark.parametrize("kind", RAW_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.7, 0.013])
def test_temperature_rows_sample_the_exhaustive_winner_from_the_raw_logits(kind, temperature,
                                                                           path):
    """Temperature-only rows (no processor, no filter) are searched in the raw logits; the
    token is the exhaustive Gumbel-max of the scratch rows (NaN as -inf, divided by the
    temperature) that `processed` returns. Rows the search cannot take (a largest value
    that is infinite, beyond the margins' limit, or -inf everywhere) take the scratch path
    and still pick that token."""
    vocab, n = 20_011, 3
    logits = raw_rows(kind, n, vocab, 7 + RAW_KINDS.index(kind))
    rows = [RowSampling(seed=seed, position=pos, temperature=temperature)
            for seed, pos in ((3, 0), (2**64 - 1, 2**32 - 1), (2**63, 41))]
    empty = [[] for _ in range(n)]
    sampler = ShardedSampler(None, 0, vocab, vocab, vocab, max_rows=n)
    x = sampler.processed(logits, rows, empty, empty).clone()
    seeds = torch.tensor([r.seed - 2**64 if r.seed >= 2**63 else r.seed for r in rows])
    positions = torch.tensor([r.position for r in rows])
    want = exhaustive(x, seeds, positions, 0)[1]
    assert torch.equal(sampler.sample(logits, rows, empty, empty), want)


@needs_native
@pytest.mark.parametrize("width", [1, 127, 128, 129, 20_011])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("scoring", ["compiled", "torch"])
def test_scaled_search_reads_the_raw_rows_as_the_scratch_holds_them(width, threads, scoring,
                                                                    monkeypatch):
    """scaled_gumbel_best on raw rows equals the exhaustive Gumbel-max of the divided rows,
    at widths around a block, with rows split over threads, and with its candidates scored
    in compiled code (torch's log) or in torch; rows it cannot take are handed back (None),
    never guessed."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if scoring == "torch":
        monkeypatch.setitem(native._STATE, "log", None)
    elif native.log_routines() is None:
        pytest.skip("vmdLn does not give torch's log on this machine")
    gen = torch.Generator().manual_seed(width)
    raw = torch.randn(4, width, generator=gen) * 4
    raw[raw > 5] = float("nan")
    temps = torch.tensor([0.7, 1.0, 2.5, 0.05])
    x = torch.nan_to_num(raw, nan=NEG_INF) / temps.unsqueeze(1)
    seeds, positions = [1, -5, 2**62, 9], [4, 0, 77, 2**31]
    want = exhaustive(x, torch.tensor(seeds), torch.tensor(positions), 1000)
    got = gumbel.scaled_gumbel_best(raw, [0, 1, 2, 3], temps, seeds, positions, 1000)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    some = gumbel.scaled_gumbel_best(raw, [3, 1], temps[[3, 1]], seeds[3::-2], positions[3::-2],
                                     1000)
    assert torch.equal(some[0], want[0][[3, 1]]) and torch.equal(some[1], want[1][[3, 1]])
    for limit in (float("inf"), 3e6):
        beyond = raw.clone()
        beyond[2, 0] = limit
        assert gumbel.scaled_gumbel_best(beyond, [0, 1, 2, 3], temps, seeds, positions,
                                         1000) is None


SPREAD_ROWS = ["cold", "confident", "confident and warm", "confident and hot", "plateau"]


def spread_rows(kind: str, width: int) -> tuple[torch.Tensor, float]:
    """Three raw rows whose largest lane sits first, mid-row and last, and their temperature:
    cold (N(0, 3^2) + 20 at T=0.2), confident (N(0, 2.5^2) + 30 at T=0.5, 0.8 or 1.0), or a
    plateau (scaled: one lane at 8, half the lanes at 0, where the plateau's best noise
    nearly always wins, the rest at -60: only a cut at least 8 below the lead's score keeps
    the winner)."""
    temperature = {"cold": 0.2, "confident": 0.5, "confident and warm": 0.8, "plateau": 0.5}
    t = temperature.get(kind, 1.0)
    if kind == "plateau":
        raw = torch.full((3, width), -60.0 * t)
        raw[:, ::2] = 0.0
    else:
        raw = rows_of("normal", 3, width, 90) * (3.0 if kind == "cold" else 2.5) / 3
    for row, lane in enumerate((0, width // 2, width - 1)):
        raw[row, lane] = 8.0 * t if kind == "plateau" else raw[row, lane] + (
            20.0 if kind == "cold" else 30.0)
    return raw, t


@pytest.fixture(params=native.VECTOR_LEVELS)
def vector_cap(request):
    """Each vector level of the compiled search (scalar, AVX2, AVX-512), capped in turn."""
    if not native.available():
        pytest.skip("no C compiler")
    try:
        yield native.vector_level(request.param)
    finally:
        native.vector_level()


@pytest.mark.parametrize("spread", SPREAD_ROWS)
@pytest.mark.parametrize("threads", [1, 6, 13])
def test_rows_spread_past_the_noise_range_keep_their_winner(spread, threads, vector_cap,
                                                             monkeypatch):
    """Rows spread wider than the noise's range: the compiled search leaves out the lanes
    below each job's cut (gumbel.c, step 1: a running cut from the largest value met, the
    blocks after a mostly-kept one drawn whole) and still picks the exhaustive winner. The
    largest lane sits first, mid-row or last (its cut from the start, halfway, or the end); with
    6 and 13 threads each row is split into 2 and 4 jobs, the later ones starting from the
    cut of the row's first lanes."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    raw, temperature = spread_rows(spread, 40_003)
    temps = torch.full((3,), temperature)
    seeds, positions = [11, -(2**63), 2**40 + 3], [0, 5, 2**32 - 1]
    want = exhaustive(raw / temps.unsqueeze(1), torch.tensor(seeds), torch.tensor(positions),
                      17)
    got = gumbel.scaled_gumbel_best(raw, [0, 1, 2], temps, seeds, positions, 17)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("greedy_pick", ["compiled", "torch"])
def test_mixed_batches_pick_each_rows_own_winner(path, greedy_pick, monkeypatch):
    """A batch mixing temperature-only rows (searched in the raw logits) and unprocessed
    greedy rows (the compiled argmax of the raw rows) with filtered and processed rows
    (through the scratch) picks, row by row, the argmax or the exhaustive Gumbel-max of the
    scratch rows `processed` returns, with FP32 and BF16 logits, NaN lanes and NaN rows."""
    if greedy_pick == "torch":
        monkeypatch.setattr("helios_logprobs.ranks.sampler.sampler.native_argmax",
                            lambda raw, which=None, checked=False: None)
    vocab = 20_011
    params = [dict(temperature=0.8), dict(temperature=0.0), dict(temperature=0.9, top_p=0.9),
              dict(temperature=1.0), dict(temperature=1.3, repetition_penalty=1.4),
              dict(temperature=0.0, logit_bias={5: 30.0}), dict(temperature=0.6),
              dict(temperature=0.0), dict(temperature=0.0)]
    rows = [RowSampling(seed=11 * i + 2, position=i, **p) for i, p in enumerate(params)]
    n = len(rows)
    prompt = [[1, 2, 3, 500]] * n
    output = [[2, 9, 30, 4000]] * n
    for dtype in (torch.float32, torch.bfloat16):
        logits = rows_of("normal", n, vocab, 21).to(dtype)
        logits[3, ::3] = float("nan")
        logits[7, 1::2] = float("nan")
        logits[8] = float("nan")
        sampler = ShardedSampler(None, 0, vocab, vocab, vocab, max_rows=n)
        x = sampler.processed(logits, rows, prompt, output).clone()
        want = []
        for i, r in enumerate(rows):
            if r.greedy:
                want.append(int(torch.argmax(x[i])))
            else:
                seeds, positions = torch.tensor([r.seed]), torch.tensor([r.position])
                want.append(int(exhaustive(x[i : i + 1], seeds, positions, 0)[1][0]))
        assert sampler.sample(logits, rows, prompt, output).tolist() == want
