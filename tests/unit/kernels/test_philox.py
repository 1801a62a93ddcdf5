from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_logprobs.kernels.noise.philox import (
    GUMBEL_MAX,
    GUMBEL_MIN,
    GUMBEL_SPAN,
    gumbel_noise,
    philox4x32,
    philox_uniform,
)

M32 = 0xFFFFFFFF


def scalar_philox(counter: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 as written in the Random123 paper, one 128-bit block at a time."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


# Random123 tests/kat_vectors, philox4x32 10: counter[4] key[2] -> output[4].
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    assert scalar_philox(counter, key) == expected
    assert tuple(int(w) for w in philox4x32(*counter, *key)) == expected


words = st.integers(0, M32)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(words, words, words, words, words, words), min_size=1, max_size=20))
def test_vectorised_matches_scalar(blocks):
    cols = [torch.tensor([b[i] for b in blocks], dtype=torch.int64) for i in range(6)]
    out = torch.stack(philox4x32(*cols), dim=1).tolist()
    assert out == [list(scalar_philox(b[:4], b[4:])) for b in blocks]


def scalar_uniform(seed: int, position: int, token_id: int) -> float:
    seed &= (1 << 64) - 1
    w = scalar_philox((token_id, position, 0, 0), (seed & M32, seed >> 32))
    return (((w[0] << 20) | (w[1] >> 12)) + 0.5) / 2.0**52


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 + 7, 2**64 - 1, -1, -(2**63)])
def test_uniform_matches_scalar(seed):
    ids = torch.tensor([0, 1, 2, 1000, 151935, 2**31 - 1])
    got = philox_uniform(seed, 7, ids).tolist()
    assert got == [scalar_uniform(seed, 7, int(t)) for t in ids]
    tensor_seed = torch.tensor(seed if seed < 2**63 else seed - 2**64)
    assert philox_uniform(tensor_seed, 7, ids).tolist() == got


def test_noise_depends_on_seed_position_and_global_id_only():
    ids = torch.arange(5000)
    full = gumbel_noise(99, 4, ids)
    assert torch.equal(gumbel_noise(99, 4, ids[1234:2345]), full[1234:2345])
    assert torch.equal(gumbel_noise(99, 4, ids.flip(0)), full.flip(0))
    batched = gumbel_noise(torch.tensor([[98], [99]]), torch.tensor([[4], [4]]), ids.expand(2, -1))
    assert torch.equal(batched[1], full)
    assert not torch.equal(batched[0], full)
    assert not torch.equal(gumbel_noise(99, 5, ids), full)


def test_chunked_path_matches_unchunked():
    ids = torch.arange(200_000)
    whole = philox_uniform(5, 9, ids)
    assert torch.equal(whole[150_000:150_100], philox_uniform(5, 9, ids[150_000:150_100]))


def test_uniform_range_and_gumbel_moments():
    u = philox_uniform(2024, 0, torch.arange(200_000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    g = gumbel_noise(2024, 0, torch.arange(200_000))
    assert abs(float(g.mean()) - 0.5772156649) < 0.01
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01


def test_gumbel_bounds_cover_extreme_uniforms():
    u = torch.tensor([2.0**-53, 1 - 2.0**-53], dtype=torch.float64)
    g = -torch.log(-torch.log(u))
    assert GUMBEL_MIN <= float(g[0]) and float(g[1]) <= GUMBEL_MAX
    assert GUMBEL_SPAN > GUMBEL_MAX - GUMBEL_MIN


def test_philox_bits_match_the_scalar_reference_across_blocks(monkeypatch):
    """philox_bits (one int64 multiply per product, garbage high words, blocks of lanes)
    gives the 52 bits of the scalar Philox for int and per-lane keys and positions."""
    import helios_logprobs.kernels.noise.philox as philox

    monkeypatch.setattr(philox, "BLOCK", 37)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 2**31, (100,), generator=gen)
    ids[:4] = torch.tensor([0, 1, 2**31 - 1, 151935])
    seeds = torch.randint(-(2**63), 2**63 - 1, (100,), generator=gen)
    positions = torch.randint(0, 2**32, (100,), generator=gen)

    def scalar_bits(seed: int, position: int, token: int) -> int:
        seed &= (1 << 64) - 1
        w = scalar_philox((token, position, 0, 0), (seed & M32, seed >> 32))
        return (w[0] << 20) | (w[1] >> 12)

    for seed, position in [(0, 0), (2**64 - 1, 7), (-5, 2**32 - 1), (123456789123, 55)]:
        k0, k1 = philox.seed_words(seed)
        got = philox.philox_bits(ids, position, k0, k1).tolist()
        assert got == [scalar_bits(seed, position, int(t)) for t in ids]
    k0, k1 = philox.seed_words(seeds)
    got = philox.philox_bits(ids, positions, k0, k1).tolist()
    triples = zip(seeds.tolist(), positions.tolist(), ids.tolist(), strict=True)
    want = [scalar_bits(s, p, t) for s, p, t in triples]
    assert got == want
    clean = philox.philox_bits(torch.arange(300), 9, 11, 13, clean=True)
    assert torch.equal(clean, philox.philox_bits(torch.arange(300), 9, 11, 13))
