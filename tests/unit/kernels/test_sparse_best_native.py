"""kernels/noise/sparse.c's sparse_best against the torch path it replaces: the lanes at or
above each row's cutoff, their float64 scores x + gumbel_noise(seed, position, id) computed
by torch, folded into (best key, smallest id) as ranks/sampler_gumbel._settle folds them."""

from __future__ import annotations

import pytest
import torch

import helios_logprobs.kernels.noise.philox_native as native
from helios_logprobs.kernels.noise.philox import gumbel_noise
from helios_logprobs.ranks.sampler.filters import NO_ID, NO_KEY, score_keys

NAN, INF = float("nan"), float("inf")

pytestmark = pytest.mark.skipif(
    not native.available() or native.log_routines() is None,
    reason="no native extension, or no MKL vmdLn equal to torch's float64 log in this torch build")


def torch_best(x, rows, low, seeds, positions, start, best, best_id):
    """The oracle: every lane of the rows with x >= low, scored and folded in torch."""
    best, best_id = best.clone(), best_id.clone()
    for r in rows:
        lanes = torch.nonzero(x[r] >= low[r]).flatten()
        if not lanes.numel():
            continue
        ids = lanes + start
        noise = gumbel_noise(seeds[r], positions[r], ids)
        keys = score_keys(x[r, lanes].to(torch.float64) + noise)
        top = int(keys.max())
        if top > int(best[r]) or top == int(best[r]):
            tied = int(ids[keys == top].min())
            best_id[r] = tied if top > int(best[r]) else min(tied, int(best_id[r]))
            best[r] = top
    return best, best_id


def native_best(x, rows, low, seeds, positions, start, best, best_id):
    best, best_id = best.clone(), best_id.clone()
    assert native.native_sparse_best(x, rows, low, seeds, positions, start, best, best_id)
    return best, best_id


def empty(n):
    return torch.full((n,), NO_KEY, dtype=torch.int64), torch.full((n,), NO_ID,
                                                                    dtype=torch.int64)


@pytest.fixture(params=native.VECTOR_LEVELS)
def level(request):
    """Each vector level of the lane search and the bits (scalar, AVX2, AVX-512)."""
    try:
        yield native.vector_level(request.param)
    finally:
        native.vector_level()


@pytest.mark.parametrize("width", [1, 5, 255, 256, 257, 1031, 3000])
def test_rows_match_the_torch_path(width, level):
    """Odd widths around the 256-lane window, cutoffs that take one lane, every lane, none,
    NaN lanes and a NaN cutoff; seeds past 2**32 and negative; positions past 2**32; an id
    offset; rows asked for in any order, the others untouched; at every vector level."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(7, width + 3, generator=gen) * 4)[:, :width]  # (rows width + 3 apart)
    x[1, ::3] = NAN
    x[2, width // 2:] = -INF
    low = torch.tensor([1.0, -2.0, -INF, NAN, float(x[4].max()), 50.0, -1.5])
    seeds = torch.tensor([3, 2**40 + 7, -5, 11, 2**63 - 1, -(2**63), 123456789])
    positions = torch.tensor([0, 7, 2**33 + 4, 1, 99, 5, 2**31])
    rows = [6, 0, 1, 2, 3, 4, 5]
    for start in (0, 70_000):
        want = torch_best(x, rows, low, seeds, positions, start, *empty(7))
        got = native_best(x, rows, low, seeds, positions, start, *empty(7))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[1][3] == NO_ID and got[1][5] == NO_ID  # (no lane at or above the cutoff)
    part = native_best(x, [4], low, seeds, positions, 70_000, *empty(7))
    assert part[1][4] == got[1][4] and part[1].tolist().count(NO_ID) == 6


def test_ties_go_to_the_smallest_id_across_windows_and_earlier_folds():
    """+inf lanes all score +inf: the smallest id wins, within a window, across windows, and
    against a (key, id) already folded in; a larger key already there stays."""
    x = torch.zeros(3, 700)
    x[:, [650, 300, 520]] = INF
    low = torch.full((3,), INF)
    seeds, positions = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    best, best_id = empty(3)
    inf_key = int(score_keys(torch.tensor([INF], dtype=torch.float64)))
    best[1], best_id[1] = inf_key, 1_000_010
    best[2], best_id[2] = inf_key, 1_000_001
    got = native_best(x, [0, 1, 2], low, seeds, positions, 1_000_000, best, best_id)
    assert got[0].tolist() == [inf_key] * 3
    assert got[1].tolist() == [1_000_300, 1_000_010, 1_000_001]
    want = torch_best(x, [0, 1, 2], low, seeds, positions, 1_000_000, best, best_id)
    assert torch.equal(got[1], want[1])


def test_threads_equal_one_thread():
    x = torch.randn(4, 100_000, generator=torch.Generator().manual_seed(2))
    low = torch.tensor([3.0, 2.5, -INF, 3.5])
    seeds, positions = torch.tensor([9, 8, 7, 6]), torch.tensor([1, 2, 3, 4])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = native_best(x, [0, 1, 2, 3], low, seeds, positions, 0, *empty(4))
        torch.set_num_threads(1)
        one = native_best(x, [0, 1, 2, 3], low, seeds, positions, 0, *empty(4))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])
    want = torch_best(x, [0, 1, 3], low, seeds, positions, 0, *empty(4))
    assert torch.equal(one[1][[0, 1, 3]], want[1][[0, 1, 3]])


def test_declines_what_it_cannot_take():
    x = torch.randn(2, 10)
    low, seeds, positions = torch.zeros(2), torch.tensor([1, 2]), torch.tensor([3, 4])
    best, best_id = empty(2)
    take = native.native_sparse_best
    assert not take(x.double(), [0], low, seeds, positions, 0, best, best_id)
    assert not take(x.t().contiguous().t(), [0], low, seeds, positions, 0, best, best_id)
    assert not take(x, [], low, seeds, positions, 0, best, best_id)
    assert not take(x, [0], low.double(), seeds, positions, 0, best, best_id)
    assert not take(x, [0], low, seeds[:1], positions, 0, best, best_id)
    assert not take(x, [0], low, seeds, positions, 2**31 - 5, best, best_id)
    assert torch.equal(best, empty(2)[0])


def test_a_log_that_is_not_torchs_is_refused(monkeypatch):
    """The start-up check: a routine other than torch's float64 log in vmdLn's place (MKL's
    log1p or exp) leaves the compiled scoring off."""
    real = native.mkl_routine
    for stand_in in ("vmdLog1p", "vmdExp"):
        monkeypatch.setattr(native, "mkl_routine",
                            lambda name, s=stand_in: real(s) if name == "vmdLn" else real(name))
        assert native._log_routines() is None
    monkeypatch.setattr(native, "mkl_routine", real)
    assert native._log_routines() is not None
