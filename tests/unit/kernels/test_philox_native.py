from __future__ import annotations

import pytest
import torch

import helios_logprobs.kernels.noise.philox as philox
import helios_logprobs.kernels.noise.philox_native as native
from helios_logprobs.kernels.noise.philox import gumbel_bounds, philox_bits, seed_words, uniform_of

M32 = 0xFFFFFFFF


def scalar_bits(seed: int, position: int, token: int) -> int:
    """Philox4x32-10 as written in the Random123 paper (see test_philox.py), 52 bits."""
    seed &= (1 << 64) - 1
    c0, c1, c2, c3 = token & M32, position & M32, 0, 0
    k0, k1 = seed & M32, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return (c0 << 20) | (c1 >> 12)


@pytest.fixture
def torch_only(monkeypatch):
    monkeypatch.setitem(native._STATE, "lib", None)


needs_native = pytest.mark.skipif(not native.available(), reason="no native extension")


@needs_native
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1031, 151_936])
def test_native_bits_equal_the_torch_path(n, monkeypatch):
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 2**31, (n,), generator=gen)
    for seed, position in [(0, 0), (2**64 - 1, 7), (-5, 2**32 - 1), (123456789123, 55)]:
        k0, k1 = seed_words(seed)
        got = philox_bits(ids, position, k0, k1)
        with monkeypatch.context() as m:
            m.setitem(native._STATE, "lib", None)
            want = philox_bits(ids, position, k0, k1)
        assert torch.equal(got, want)
        picks = torch.arange(0, n, max(1, n // 50))
        assert [int(got[i]) for i in picks] == [
            scalar_bits(seed, position, int(ids[i])) for i in picks
        ]


@needs_native
@pytest.mark.parametrize("cap", native.VECTOR_LEVELS)
def test_every_vector_level_writes_the_random123_bits(cap):
    """Lengths around the AVX-512 loop's 32 lanes and the AVX2 loop's 8: each level takes
    what it can and leaves the rest to the next one down."""
    gen = torch.Generator().manual_seed(3)
    try:
        level = native.vector_level(cap)
        for n in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 47, 64, 71, 1031):
            ids = torch.randint(0, 2**31, (n,), generator=gen)
            for seed, position in [(2**64 - 1, 7), (123456789123, 2**32 - 1)]:
                got = philox_bits(ids, position, *seed_words(seed))
                assert [int(v) for v in got] == [
                    scalar_bits(seed, position, int(i)) for i in ids
                ], (level, n)
            # and with a key and position per lane (the sparse path)
            seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
            positions = torch.randint(-5, 2**33, (n,), generator=gen)
            got = philox_bits(ids, positions, *seed_words(seeds))
            assert [int(v) for v in got] == [
                scalar_bits(int(s), int(p) & M32, int(i))
                for s, p, i in zip(seeds, positions, ids, strict=True)
            ], (level, n)
    finally:
        native.vector_level()
    assert level in native.VECTOR_LEVELS[: native.VECTOR_LEVELS.index(cap) + 1]


@needs_native
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_native_bits_with_a_key_per_lane_equal_the_torch_path(n, monkeypatch):
    """The sparse Gumbel-max draws lanes of several rows at once: a seed and position per
    lane (negative and >= 2**32 values are taken modulo 2**32 like the torch path)."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 2**31, (n,), generator=gen)
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    positions = torch.randint(-5, 2**33, (n,), generator=gen)
    k0, k1 = seed_words(seeds)
    got = philox_bits(ids, positions, k0, k1)
    with monkeypatch.context() as m:
        m.setitem(native._STATE, "lib", None)
        want = philox_bits(ids, positions, k0, k1)
    assert torch.equal(got, want)
    for i in range(0, n, max(1, n // 20)):
        assert int(got[i]) == scalar_bits(int(seeds[i]), int(positions[i]) & M32, int(ids[i]))


@needs_native
def test_native_bounds_equal_the_torch_path(monkeypatch):
    m = torch.randint(0, 2**52, (10_001,), generator=torch.Generator().manual_seed(1))
    got = gumbel_bounds(m)
    monkeypatch.setitem(native._STATE, "lib", None)
    assert torch.equal(got, gumbel_bounds(m))


def test_native_declines_what_it_cannot_take():
    ids = torch.arange(10)
    out = torch.empty(10, dtype=torch.int64)
    assert not native.native_bits(ids.to(torch.int32), 0, 1, 2, out)
    assert not native.native_bits(ids[::2], 0, 1, 2, out[:5])
    assert not native.native_bits(ids, 0, 1, 2, out[:9])
    keys = torch.zeros(10, dtype=torch.int64)
    assert not native.native_bits_lanes(ids, keys.to(torch.int32), keys, keys, out)
    assert not native.native_bits_lanes(ids, keys[:9], keys, keys, out)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_gumbel_bounds_cover_the_noise(path, monkeypatch):
    """Every m, including the ones nearest 2**52 - 1 (the largest noise) and every power-of-
    two boundary of h = (2**52 - 1 - m) >> 21, has noise <= its bound."""
    if path == "torch":
        monkeypatch.setitem(native._STATE, "lib", None)
    top = 2**52 - 1
    edges = [top - k for k in range(5000)]
    for b in range(53):
        edges += [top ^ ((1 << b) - 1), max(0, top - (1 << b)), max(0, top - (1 << b) + 1)]
    gen = torch.Generator().manual_seed(2)
    m = torch.cat((torch.tensor(edges), torch.randint(0, 2**52, (300_000,), generator=gen)))
    noise = uniform_of(m).log_().neg_().log_().neg_()
    bound = gumbel_bounds(m).to(torch.float64)
    assert bool((bound >= noise).all())
    # tight where the noise is large (that is what makes pruning work), except for h = 0
    big = (noise > 10) & (torch.bitwise_xor(m, top) >> 21 > 0)
    assert int(big.sum()) > 50 and float((bound - noise)[big].max()) < 0.76


def test_philox_bits_falls_back_for_tensor_keys():
    ids = torch.arange(100)
    keys = seed_words(torch.full((100,), 77))
    got = philox.philox_bits(ids, torch.full((100,), 3), *keys)
    assert torch.equal(got, philox.philox_bits(ids, 3, *seed_words(77)))


@needs_native
@pytest.mark.parametrize("width", [1, 7, 8, 9, 423, 4099])
def test_cutoff_lanes_are_torch_nonzero_of_the_rows_taken(width):
    """Lanes equal to the cutoff count, NaN lanes and a NaN cutoff never do, a -inf cutoff
    takes every lane that is not NaN; only the rows asked for, in row-major order."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(6, width + 5, generator=gen)[:, :width]  # (rows `width + 5` apart)
    x[1, :: 3] = float("nan")
    x[2, :: 2] = float("-inf")
    low = torch.tensor([0.5, 0.0, float("-inf"), float("nan"), 9.0, float(x[5, 0])])
    rows = [0, 1, 2, 3, 5]
    row, lane = native.native_cutoff_lanes(x, rows, low)
    index = torch.tensor(rows)
    want_row, want_lane = torch.nonzero(
        x.index_select(0, index) >= low.index_select(0, index).unsqueeze(1), as_tuple=True)
    assert torch.equal(row, index.index_select(0, want_row))
    assert torch.equal(lane, want_lane)
    assert 0 in lane[row == 5].tolist()


@needs_native
def test_cutoff_lanes_decline_what_they_cannot_take():
    x = torch.randn(2, 10)
    low = torch.zeros(2)
    assert native.native_cutoff_lanes(x.double(), [0], low) is None
    assert native.native_cutoff_lanes(x.t(), [0], low) is None
    assert native.native_cutoff_lanes(x, [], low) is None
    assert native.native_cutoff_lanes(x, [0], low.double()) is None


@needs_native
def test_cutoff_lanes_split_across_threads_equal_one_thread():
    x = torch.randn(4, 100_000, generator=torch.Generator().manual_seed(8))
    low = torch.tensor([2.0, 3.0, float("-inf"), 1.0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = native.native_cutoff_lanes(x, [0, 1, 3], low)
        torch.set_num_threads(1)
        one = native.native_cutoff_lanes(x, [0, 1, 3], low)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(two, one, strict=True))


@pytest.mark.parametrize("level", ["avx512", "avx2", "scalar"])
def test_scaled_rows_are_the_scratch_copy_and_division(level):
    """native_scaled_rows writes what torch's nan_to_num copy and div_ write, word for word,
    at every vector level: NaN, both infinities, both zeros, subnormals, temperatures of 1
    (a copy), FLOAT32_MAX and tiny ones, a row width that leaves a vector tail, and a
    destination with a row stride of its own."""
    if not native.available():
        pytest.skip("no native extension")
    used = native.vector_level(level)
    try:
        gen = torch.Generator().manual_seed(3)
        src = torch.randn(6, 1001, generator=gen) * 50
        src[:, 1::7] = float("nan")
        src[:, 2::11] = float("inf")
        src[:, 3::13] = float("-inf")
        src[:, 4::17] = -0.0
        src[:, 5::19] = 1e-42
        temps = torch.tensor([1.0, 0.7, 3.4e38, 1e-5, 2.0, 1.3], dtype=torch.float32)
        inf = float("inf")
        want = torch.nan_to_num(src, nan=-inf, posinf=inf, neginf=-inf).div_(temps.unsqueeze(1))
        out = torch.full((6, 1100), 7.0)[:, :1001]
        assert native.native_scaled_rows(src, temps, out)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), used
        assert not native.native_scaled_rows(src.double(), temps, out)
    finally:
        native.vector_level("avx512")
