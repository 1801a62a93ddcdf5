"""The compiled radix lanes (kernels/radix) against the torch lanes of ranks/sampler/filters:
the same histograms round by round, the same cuts and masks, the same sampled tokens."""

from __future__ import annotations

import math

import pytest
import torch

import helios_logprobs.kernels.radix.native as native
from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.kernels.radix.native import RadixLanes
from helios_logprobs.ranks.sampler.filters import (
    FILTER_WORDS,
    RADIX_ROUNDS,
    TorchRadixLanes,
    probability_scale,
    probability_weights,
    radix_thresholds,
    value_keys,
)
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

needs_native = pytest.mark.skipif(not native.available(), reason="no native extension or no MKL")


def awkward_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """FP32 rows with what the keys and weights must get right: both zeros, -inf lanes, ties
    with the row maximum, a subnormal, values far below the maximum (weight 0) and values
    just above the fixed point's last bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 4
    pick = torch.randint(0, width, (rows, 12), generator=gen)
    x.scatter_(1, pick[:, :2], 0.0)
    x.scatter_(1, pick[:, 2:4], -0.0)
    x.scatter_(1, pick[:, 4:6], float("-inf"))
    x.scatter_(1, pick[:, 6:7], 1e-40)
    x.scatter_(1, pick[:, 7:8], -80.0)
    top = x.amax(1, keepdim=True)
    x.scatter_(1, pick[:, 8:10], top.expand(-1, 2))
    x.scatter_(1, pick[:, 10:12], (top - 30.0).expand(-1, 2))
    return x


def peaked_rows(rows: int, width: int, seed: int, vocab: int) -> torch.Tensor:
    """FP32 rows of a confident model: one lane far above the rest, so most lanes' weight is 0
    and radix.c's start takes exp only of the live lanes of most tiles. Planted: lanes on
    both sides of the weight-0 boundary (d = -log(scale)) and of the cut that skips the exp
    (1/64 below it), a tile with a quarter of its lanes live and one with a lane fewer, and
    a tile of lanes near the maximum."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 2.5
    x[:, width // 2] = 40.0
    boundary = 40.0 - math.log(probability_scale(vocab))
    offsets = [-0.03, -2.0**-6 - 1e-5, -2.0**-6 + 1e-5, -1e-4, -1e-6, 0.0, 1e-6, 1e-4, 0.02]
    plants = torch.tensor([boundary + o for o in offsets])
    x[:, 7 : 7 + len(plants)] = plants
    if width >= 4 * 1024:
        x[:, 1024 : 1024 + 256] = 39.0  # (a quarter of the tile live)
        x[:, 2048 : 2048 + 255] = 38.0  # (a lane fewer)
        x[:, 3072 : 4096] += 38.0
    return x


def torch_lanes(x: torch.Tensor, row_max: torch.Tensor | None, vocab: int) -> TorchRadixLanes:
    keys = value_keys(x)
    if row_max is None:
        return TorchRadixLanes(keys, torch.ones_like(keys))
    return TorchRadixLanes(keys, probability_weights(x, row_max, vocab))


@needs_native
@pytest.mark.parametrize("rows,width", [(1, 423), (3, 1031), (5, 4096), (2, 151_936)])
@pytest.mark.parametrize("unit", [False, True])
@pytest.mark.parametrize("logits", ["awkward", "peaked"])
def test_every_round_sums_what_the_torch_lanes_sum(rows, width, unit, logits):
    vocab = width + 7
    x = (awkward_rows(rows, width, seed=rows * width) if logits == "awkward"
         else peaked_rows(rows, width, rows * width, vocab))
    row_max = None if unit else x.amax(1)
    ours = RadixLanes.start(x, row_max, probability_scale(vocab))
    theirs = torch_lanes(x, row_max, vocab)
    gen = torch.Generator().manual_seed(width)
    previous = None
    for shift, bits in RADIX_ROUNDS:
        got = ours.histogram(shift, bits, previous)
        want = theirs.histogram(shift, bits, previous)
        assert torch.equal(got, want), (shift, bits)
        # The next round keeps a bucket that holds lanes (or, for some rows, an empty one).
        occupied = [torch.nonzero(h).flatten() for h in want]
        chosen = torch.tensor([
            int(o[torch.randint(0, len(o), (1,), generator=gen)]) if len(o) and r % 3 else 0
            for r, o in enumerate(occupied)])
        previous = (shift, bits, chosen)


@needs_native
@pytest.mark.parametrize("unit", [False, True])
def test_cuts_and_masks_equal_the_torch_path(unit):
    x = awkward_rows(6, 3001, seed=11)
    vocab = 3001
    row_max = None if unit else x.amax(1)
    exchange = WordExchange(None, 6, FILTER_WORDS)
    targets = torch.tensor([1.0, 2.0, 37.0, 300.0, 2999.0, 5000.0] if unit
                           else [0.05, 0.3, 0.5, 0.9, 0.999, 1e-9], dtype=torch.float64)
    ours = RadixLanes.start(x, row_max, probability_scale(vocab))
    theirs = torch_lanes(x, row_max, vocab)
    cut = radix_thresholds(ours, targets, not unit, exchange)
    assert torch.equal(cut, radix_thresholds(theirs, targets, not unit, exchange))
    mask = ours.below(cut)
    assert torch.equal(mask, theirs.below(cut))
    assert 0 < int(mask.sum()) < mask.numel()
    removed, want = x.clone(), x.masked_fill(mask, float("-inf"))
    theirs.remove_below(removed, cut)
    assert torch.equal(removed, want)
    ours.remove_below(x, cut)  # (in place, on the rows it started on)
    assert torch.equal(x, want)
    with pytest.raises(ValueError, match="not the rows"):
        ours.remove_below(x.clone(), cut)


@needs_native
def test_a_round_wider_than_the_histograms_is_refused():
    lanes = RadixLanes.start(torch.randn(2, 50), None, 1.0)
    with pytest.raises(ValueError, match="bits 8"):
        lanes.histogram(0, 8, None)


def test_start_declines_what_it_cannot_take():
    x = torch.randn(2, 50)
    scale = probability_scale(50)
    assert RadixLanes.start(x.double(), None, scale) is None
    assert RadixLanes.start(x.t(), None, scale) is None
    assert RadixLanes.start(x, torch.tensor([1.0, float("inf")]), scale) is None
    assert RadixLanes.start(x[:, :0], None, scale) is None


@needs_native
@pytest.mark.parametrize("params", [
    dict(top_p=0.9), dict(top_p=0.3, temperature=1.7), dict(top_k=700, temperature=0.6),
    dict(top_k=300, top_p=0.5, min_p=0.01), dict(top_p=0.95, repetition_penalty=1.3),
])
def test_sampled_tokens_do_not_depend_on_the_path(params, monkeypatch):
    vocab, n = 5003, 6
    logits = awkward_rows(n, vocab, seed=5)
    rows = [RowSampling(seed=40 + i, position=p, **params) for i in range(n) for p in range(3)]
    sampler = ShardedSampler(None, 0, vocab, vocab, vocab, max_rows=len(rows))
    batch = logits.repeat_interleave(3, dim=0)
    prompts = [[1, 2, 3]] * len(rows)
    outputs = [[int(batch[i].argmax()), 7] for i in range(len(rows))]
    got = sampler.sample(batch, rows, prompts, outputs)
    monkeypatch.setitem(native._STATE, "lib", None)
    assert torch.equal(got, sampler.sample(batch, rows, prompts, outputs))


@needs_native
def test_blocks_past_the_kept_size_get_buffers_of_their_own(monkeypatch):
    monkeypatch.setattr(native, "KEPT_LANES", 100)
    monkeypatch.setattr(native, "_BUFFERS", native._Buffers())
    small = RadixLanes.start(torch.randn(2, 50), None, 1.0)
    large = RadixLanes.start(torch.randn(3, 50), None, 1.0)
    assert native._BUFFERS.keys.numel() == 100
    assert small.keys.data_ptr() == native._BUFFERS.keys.data_ptr()
    assert large.keys.data_ptr() != small.keys.data_ptr()


@needs_native
def test_rows_split_across_threads_cut_where_one_thread_cuts():
    x = awkward_rows(4, 100_003, seed=4)
    exchange = WordExchange(None, 4, FILTER_WORDS)
    targets = torch.tensor([0.5, 0.9, 0.99, 1e-6], dtype=torch.float64)
    threads = torch.get_num_threads()
    cuts = []
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            lanes = RadixLanes.start(x, x.amax(1), probability_scale(100_003))
            cuts.append(radix_thresholds(lanes, targets, True, exchange))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cuts[0], cuts[1])
    assert torch.equal(cuts[0], radix_thresholds(torch_lanes(x, x.amax(1), 100_003), targets,
                                                 True, exchange))


@needs_native
@pytest.mark.parametrize("rows,width,k", [(1, 423, 1), (3, 1031, 50), (2, 17, 17), (4, 4099, 256),
                                          (16, 151_936, 50), (2, 40, 16)])
def test_top_values_are_torch_topk_values(rows, width, k):
    """Each row's k largest values, largest first, as torch.topk gives them: ties, both
    zeros, -inf lanes and a maximum repeated, at widths that leave a partial block."""
    x = awkward_rows(rows, width, seed=width + k)
    x[:, ::5] = x[:, ::5].round()
    want = torch.topk(x, k, dim=1, sorted=True).values
    got = native.top_values(x, k)
    assert torch.equal(got, want)
    assert native.top_values(x[:, :0], 1) is None and native.top_values(x, width + 1) is None


@pytest.mark.parametrize("compiled", [True, False])
def test_kth_cut_keeps_the_values_at_or_above_each_rows_kth(compiled, monkeypatch):
    """remove_below_kth drops exactly the lanes below the k-th largest value in the rows it
    is asked to cut (ties at the k-th value all stay; +0.0 and -0.0 are one value) and leaves
    the others, compiled or in torch."""
    from helios_logprobs.ranks.sampler.filters import max_and_topk, remove_below_kth

    if not compiled:
        monkeypatch.setattr("helios_logprobs.ranks.sampler.filters.fill_below",
                            lambda x, cut: False)
    elif not native.available():
        pytest.skip("no native extension or no MKL")
    x = awkward_rows(4, 3001, seed=5)
    x[1] = -x[1].abs() - 1.0  # (row 1's 7th largest value is a zero: all 20 zeros stay)
    x[:, 100:110] = 0.0
    x[:, 110:120] = -0.0
    ks = torch.tensor([1, 7, 250, 3])
    small = torch.tensor([True, True, True, False])
    _, kth = max_and_topk(x, ks, WordExchange(None, 4, FILTER_WORDS))
    want = x.clone()
    for r in range(3):
        bound = torch.topk(x[r], int(ks[r])).values[-1]
        want[r][x[r] < bound] = float("-inf")
    remove_below_kth(x, kth, small)
    assert torch.equal(x, want)


@needs_native
def test_min_p_cut_is_the_torch_cut_at_the_boundary():
    """fill_min_p drops what `relative_probs(x, max) < min_p` drops, with lanes placed on each
    row's boundary and on its FP32 neighbours (where only torch's exp can decide), floors of
    1 and of 1e-30, a row whose maximum is +inf and a row of -inf only."""
    from helios_logprobs.ranks.sampler.filters import relative_probs

    x = awkward_rows(6, 5003, seed=9)
    floors = torch.tensor([0.05, 0.5, 1.0, 1e-30, 0.3, 0.1], dtype=torch.float64)
    x[4, 17] = float("inf")
    x[5] = float("-inf")
    row_max = x.amax(1)
    for r in range(4):
        edge = torch.tensor(float(row_max[r]) + math.log(float(floors[r])), dtype=torch.float32)
        for j in range(-3, 4):
            x[r, 40 + j] = edge
            edge = torch.nextafter(edge, torch.tensor(float("inf")))
    want = x.masked_fill(relative_probs(x, row_max) < floors.unsqueeze(1), float("-inf"))
    got = x.clone()
    assert native.fill_min_p(got, row_max, floors)
    assert torch.equal(got, want)
    assert int((want[:4, 37:44] == float("-inf")).sum()) not in (0, 28)  # (a boundary crossed)
    with pytest.raises(ValueError, match="floors"):
        native.fill_min_p(got, row_max, torch.zeros(6, dtype=torch.float64))
