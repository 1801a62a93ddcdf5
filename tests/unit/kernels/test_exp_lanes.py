"""exp_lanes.c: the reduction's AVX-512 exp gives torch.exp's FP32 words.

The oracle is torch.exp itself (MKL's vmsExp in torch's mode, which the library's
exp_mismatches calls on the same inputs). The copy runs only where the probe turned it on;
where it is off, exp_lanes is vmsExp and the probe tests below still run."""

from __future__ import annotations

import ctypes

import pytest
import torch

from helios_logprobs.kernels.cpu import compiled, exp_check

pytestmark = pytest.mark.skipif(not compiled.available(),
                                reason="no compiled reduction on this machine")

BOUND = exp_check.BOUND
SIGN = 1 << 31


def _emulated() -> ctypes.CDLL:
    if not compiled.emulated_exp():
        pytest.skip("exp_lanes.c's AVX-512 exp is off here (no AVX-512F, or MKL runs another "
                    "exp kernel than the one it repeats)")
    return compiled._lib()


def _mismatches(lib: ctypes.CDLL, first: int, count: int) -> tuple[int, int]:
    where = ctypes.c_uint32(0)
    return lib.exp_mismatches(first, count, ctypes.byref(where)), where.value


@pytest.mark.parametrize("sign", [0, SIGN], ids=["positive", "negative"])
def test_every_word_of_the_main_branch_matches_torch_exp(sign) -> None:
    """All 1,118,743,632 words with |x| <= the bound, on each side of zero (~3.5 s each):
    the emulated lanes are exactly these, so nothing is left to chance on this machine."""
    lib = _emulated()
    differ, where = _mismatches(lib, sign, BOUND + 1)
    assert differ == 0, f"{differ} words differ, the first 0x{where:08x}"


def test_words_past_the_bound_go_to_vmsexp() -> None:
    """Overflow, the underflow into subnormals and zero, infinities and NaNs (payloads
    compared too): blocks holding them are vmsExp's, mixed into emulated blocks."""
    lib = _emulated()
    for first, count in [(BOUND + 1, 1 << 20), (SIGN | (BOUND + 1), 1 << 22),
                         (0x7F7FF000, 0x2000), (0xFF7FF000, 0x2000), (0x7FFFF000, 0x1000)]:
        differ, where = _mismatches(lib, first, count)
        assert differ == 0, f"{differ} words differ, the first 0x{where:08x}"


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 4095, 4096, 4097, 8192 + 31])
def test_exp_lanes_at_odd_lengths_with_lanes_past_the_bound(n) -> None:
    """Tails under a vector, several passes, and blocks where one lane leaves the main
    branch: every word equals torch.exp of the same tensor."""
    lib = compiled._lib()
    g = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=g) * -30
    x[:: 97] = -100.0
    x[5 % n] = float("-inf")
    x[n // 2] = float("nan")
    want = torch.exp(x)
    lib.exp_lanes(x.data_ptr(), n)
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))


def test_the_probe_refuses_another_rounding() -> None:
    """A reference that rounds otherwise (exp in float64, rounded to FP32) differs from the
    library on some probe input, and the message names the word and both results."""
    failed = exp_check.differs(compiled._lib(), lambda x: torch.exp(x.double()).float())
    assert failed.startswith("exp of word 0x") and "where the reference gives 0x" in failed


def test_the_probe_inputs_cover_the_roundings_and_the_bound() -> None:
    """The inputs reach both sides of the bound and land next to half-way points of step 1
    (x * 128 / ln 2 within 1e-3 of k + 1/2), where another algorithm rounds differently."""
    x = exp_check.probe_inputs()
    words = x.view(torch.int32) & 0x7FFFFFFF
    assert (words == BOUND).any() and (words == BOUND + 1).any()
    steps = x.double() * 128 / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert int(((steps - steps.floor() - 0.5).abs() < 1e-3).sum()) > 20_000


def test_the_reduction_is_the_same_with_the_copy_on_and_off() -> None:
    """Launch 1 over bf16 rows of 151,936 ids (with -inf and very negative lanes) gives the
    same statistics through the copy as through vmsExp."""
    lib = _emulated()
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 151_936, generator=g) * 6).to(torch.bfloat16)
    x[1, ::13] = float("-inf")
    x[2, ::5] = -200.0
    rows = torch.arange(4).numpy()
    results = []
    try:
        for on in (True, False):
            assert compiled.set_emulated_exp(lib, on) is on
            stats, _ = compiled.compiled_tile_stats(x, rows, 151_936, 4096)
            results.append([t.clone() for t in stats])
    finally:
        compiled.set_emulated_exp(lib, True)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
