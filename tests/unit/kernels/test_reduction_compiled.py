"""The compiled CPU launches (kernels/cpu/compiled.c) against the torch launches they
reproduce word for word, and the probe that keeps them off where they would differ.

Oracles: kernels/cpu/tiles.py's tile-by-tile launches (torch ops only) and the numpy
fast path with the library switched off; the float64 oracle checks the payloads too.
"""

from __future__ import annotations

import logging
import os
import platform

import numpy as np
import pytest
import torch

import helios_logprobs.kernels.cpu.lean as lean
from helios_logprobs.kernels.api import pack_token_ids, reduce_logprobs
from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.cpu.backend import reduce_torch, reduce_torch_repeated
from helios_logprobs.kernels.cpu.tiles import TileStats, normalization, tile_stats
from helios_logprobs.kernels.native import extension_path, mkl_routine
from helios_logprobs.kernels.rows import RowRequest
from tests.oracles import WORDS, check_payload

needs_compiled = pytest.mark.skipif(not compiled.available(),
                                    reason="no native extension, MKL or AVX2 on this machine")


def same_words(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal FP32 words, -0.0 read as +0.0 and any NaN as any NaN."""
    got, want = got.contiguous() + 0.0, want.contiguous() + 0.0
    nan = got.isnan()
    return bool(got.shape == want.shape and torch.equal(nan, want.isnan())
                and torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan]))


def logits_of(kind: str, rows: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    if kind == "ties":
        x = torch.randint(-2, 3, (rows, width), generator=g).float()
    elif kind == "flat":  # zeros but 70 distinct values: every lane passes the chunk floor;
        x = torch.zeros(rows, width)  # the 40 largest early, 30 smaller ones late
        x[:, torch.arange(40) * 10] = (torch.arange(40) + 61) / 4
        x[:, width - 300 + torch.arange(30) * 10] = (torch.arange(30) + 1) / 4
    elif kind == "special":
        x[0, ::5] = float("-inf")
        if rows > 1:
            x[1] = float("-inf")
        if rows > 2:
            x[2, width // 3] = float("nan")
        if rows > 3:
            x[3, width - 1] = float("inf")
    return x.to(dtype)


def test_compiled_path_is_on_where_it_can_be() -> None:
    """On an AVX2 or AVX512 x86 machine (AMD EPYC and Intel Sapphire Rapids seen) with the
    native extension built and a torch build with MKL, the probe passes: the fast path is not
    silently off (the benchmarks measure it). Elsewhere the probe decides; a mismatch only
    costs speed."""
    capability = torch.backends.cpu.get_cpu_capability()
    if (platform.machine().lower() not in ("x86_64", "amd64") or extension_path() is None
            or capability not in ("AVX2", "AVX512") or mkl_routine("vmsExp") is None
            or os.environ.get("HELIOS_NATIVE") == "0"):
        pytest.skip("the compiled path cannot apply here")
    assert compiled.available()


def test_the_vector_width_is_the_one_torch_sums_with() -> None:
    """The width is read off torch's sum, not the capability's vector width (an AVX512
    capability still sums in 8-lane vectors): over one row of two vectors' lanes, torch
    adds the vectors lane-wise and then the lanes in order (float32 numpy arithmetic)."""
    width = compiled._vector_width()
    if width is None:
        pytest.skip("torch's CPU capability is neither AVX2 nor AVX512")
    rows = torch.rand(500, 2 * width, generator=torch.Generator().manual_seed(5)) * 1000
    for row, total in zip(rows.numpy(), rows.sum(-1).numpy(), strict=True):
        lanes = row[:width] + row[width:]
        want = np.float32(0)
        for lane in lanes:
            want = np.float32(want + lane)
        assert want == total


@needs_compiled
@pytest.mark.parametrize(("rows", "valid", "tile"), [
    (1, 32_000, 4096), (3, 151_936, 4096), (4, 4103, 4096), (4, 8197, 4096), (5, 423, 4096),
    (4, 1031, 64), (3, 37, 16), (2, 5, 16), (4, 1000, 512),
])
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launches_1_and_2_equal_the_torch_launches(rows, valid, tile, kind, dtype) -> None:
    x = logits_of(kind, rows + 2, valid + 9, rows * valid, dtype)[:, 3:]  # strided rows
    picked = np.array([rows + 1] + list(range(rows - 1)), dtype=np.int64)
    for threads in (1, 2):
        got, _ = compiled._run(compiled._lib(), x, picked, valid, tile, 0, threads)
        want = tile_stats(x, torch.from_numpy(picked), valid, tile)
        for name, a, b in zip(TileStats._fields, got, want, strict=True):
            assert same_words(a, b), name
        lse, _ = compiled.compiled_lse(got)
        assert same_words(torch.from_numpy(lse), normalization(want))


@needs_compiled
@pytest.mark.parametrize(("valid", "tile"), [(4103, 4096), (423, 4096), (37, 16), (5, 16),
                                             (1000, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_in_any_lane_of_a_tile_makes_its_maxima_nan(valid, tile, dtype) -> None:
    """Launch 1 reads each tile in one pass: a NaN among the 16 strided chunks, in the lanes
    past them (the last tile's remainder) or in a tile's first lane reaches the tile maximum
    and its chunk as in the torch launch."""
    rest = valid % tile or tile
    last_start = valid - rest
    lanes = sorted({0, last_start, last_start + 16 * (rest // 16), valid - 1} - {valid})
    x = torch.randn(len(lanes) + 1, valid, generator=torch.Generator().manual_seed(valid))
    for row, lane in enumerate(lanes):
        x[row, lane] = float("nan")
    x = x.to(dtype)
    rows = np.arange(x.shape[0], dtype=np.int64)
    for threads in (1, 2):
        got, _ = compiled._run(compiled._lib(), x, rows, valid, tile, 0, threads)
        want = tile_stats(x, torch.from_numpy(rows), valid, tile)
        for name, a, b in zip(TileStats._fields, got, want, strict=True):
            assert same_words(a, b), name


def _three_ways(monkeypatch, call):
    """(compiled, numpy fast path, tile-by-tile) results of call()."""
    got = call()
    with monkeypatch.context() as m:
        m.setitem(compiled._STATE, "lib", None)
        numpy_path = call()
    with monkeypatch.context() as m:
        m.setattr(lean, "LEAN", False)
        tiles = call()
    return got, numpy_path, tiles


PAYLOAD_CASES = [
    (vocab, kind, dtype)
    for vocab in (7, 64, 65, 300, 1031, 4097, 40_000, 151_936)
    for kind in ("normal", "ties", "special")
    for dtype in (torch.float32, torch.bfloat16)
    if vocab != 151_936 or kind == "normal"  # (the tile launches are slow at this width)
]


@needs_compiled
@pytest.mark.parametrize(("vocab", "kind", "dtype"), PAYLOAD_CASES)
def test_payloads_equal_the_numpy_path_and_the_tile_launches(monkeypatch, vocab, kind,
                                                              dtype) -> None:
    rows = 5
    x = logits_of(kind, rows, vocab + 3, vocab, dtype)
    chosen = torch.arange(rows) * 11 % vocab
    requested = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    token_ids = [[], [0], [vocab - 1, 0], [], []]
    for kw in (dict(), dict(k=0), dict(k=1, requested=requested), dict(token_ids=token_ids)):
        results = _three_ways(
            monkeypatch, lambda kw=kw: reduce_logprobs(x, chosen, vocab_size=vocab, **kw))
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2]), kw
        if kind == "normal":
            check_payload(results[0], x, vocab, chosen, kw.get("k", 20),
                          kw.get("token_ids"), kw.get("requested"))


@needs_compiled
@pytest.mark.parametrize("vocab", [2100, 3000, 4000])
@pytest.mark.parametrize("kind", ["flat", "ties", "normal"])
def test_narrow_rows_with_many_candidates_keep_a_bounded_buffer(monkeypatch, vocab, kind):
    """Rows too narrow for the chunk prefilter whose lanes mostly reach the chunk floor: the
    candidate buffer (1,024 lanes) is cut back by quickselect as it fills; the payload is
    still the numpy path's and the tile launches'."""
    x = logits_of(kind, 3, vocab, vocab, torch.bfloat16)
    chosen = torch.tensor([0, vocab // 2, vocab - 1])
    results = _three_ways(monkeypatch, lambda: reduce_logprobs(x, chosen))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    check_payload(results[0], x, vocab, chosen, 20, None, None)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_narrow_row_tied_across_the_kth_value_is_not_vouched_for(monkeypatch, dtype):
    """A narrow row: 64 lanes tie at 5.0 from lane 0, and 19 lanes at 10.0 come last (or
    first). The picks hold only some of the tied lanes, so the 20th value is a tie with lanes
    left out and the picks must not vouch for the row: the payload is still the numpy path's
    and the tile launches' (lane 0 is the 20th)."""
    vocab, rows = 300, 2
    x = torch.full((rows, vocab), -3.0)
    x[:, :64] = 5.0
    x[:, vocab - 19 :] = 10.0
    x[1] = x[1].flip(0)  # (the same ties met in the other order)
    x = x.to(dtype)
    chosen = torch.tensor([0, vocab - 1])
    results = _three_ways(monkeypatch, lambda: reduce_logprobs(x, chosen))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    check_payload(results[0], x, vocab, chosen, 20, None, None)


@needs_compiled
def test_a_lane_below_the_floor_tied_by_the_subtraction_is_not_left_out(monkeypatch):
    """Launch 1's floor keeps exactly 32 lanes of a narrow row: a 1000.0 lane, and 31 lanes
    just above 0.5 in 31 chunks. Lane 41 (0.5, its own chunk) falls below the floor, yet
    every one of these 32 reports -999.5 once the lse (~1000) is subtracted, so the 19 best
    after lane 1000 are the smallest ids of the tie: lane 41, then lanes 500-517. The picks'
    bound is lane 41's value, so they must not vouch for the row."""
    vocab = 1031
    x = torch.full((1, vocab), -5.0)
    x[0, 1000] = 1000.0
    tied = list(range(500, 531))  # chunks 52-63 and 0-18 (lane % 64)
    for i, lane in enumerate(tied):
        x[0, lane] = 0.5 + (i + 1) * 1e-7
    x[0, 41] = 0.5
    reported = x[0] - torch.logsumexp(x[0], 0)
    assert len(set(reported[[41, *tied]].tolist())) == 1  # the tie the test is about
    chosen = torch.tensor([1000])
    results = _three_ways(monkeypatch, lambda: reduce_logprobs(x, chosen))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert results[0][0, 2:42:2].tolist() == [1000, 41, *range(500, 518)]


@needs_compiled
def test_rows_it_cannot_vouch_for_take_the_tile_launch(monkeypatch) -> None:
    """Exact ties across the 32nd value (bf16 integers): the candidates cannot vouch for the
    row, the tile-by-tile launch 3 decides it, and the payload is still the same."""
    vocab, rows = 40_000, 3
    x = logits_of("ties", rows, vocab, 1, torch.bfloat16)
    ids, counts = pack_token_ids(None, rows, vocab)
    chosen = torch.tensor([0, 1, 2])
    flags = torch.ones(rows, dtype=torch.int32)
    out = torch.full((rows, WORDS), -1, dtype=torch.int32)
    redo, _, _ = compiled.compiled_reduce(
        x, np.arange(rows), vocab, 4096, chosen.numpy().astype(np.int64), counts.numpy(),
        ids.numpy(), 20, False, out)
    assert (redo == 1).all()
    request = RowRequest(chosen, ids, counts, flags, 20)
    results = _three_ways(monkeypatch, lambda: reduce_torch(
        x, request, vocab, torch.full((rows, WORDS), -1, dtype=torch.int32)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    check_payload(results[0], x, vocab, chosen, 20, None, None)


@needs_compiled
def test_ids_outside_the_vocabulary_are_left_to_the_python_path(monkeypatch) -> None:
    """A prepared request may name a padding lane (validation happens at the API): the
    compiled path never reads it itself and hands the call back."""
    vocab, width, rows = 1000, 1024, 2
    x = logits_of("normal", rows, width, 3, torch.float32)
    ids, counts = pack_token_ids([[], [3]], rows, vocab)
    ids[1, 0] = vocab + 5
    chosen = torch.tensor([vocab + 1, 4])
    request = RowRequest(chosen, ids, counts, torch.ones(rows, dtype=torch.int32), 20)
    out = torch.full((rows, WORDS), -1, dtype=torch.int32)
    redo, _, _ = compiled.compiled_reduce(
        x, np.arange(rows), vocab, 4096, chosen.numpy().astype(np.int64), counts.numpy(),
        ids.numpy(), 20, False, out)
    assert list(redo) == [2, 2]
    results = _three_ways(monkeypatch, lambda: reduce_torch(
        x, request, vocab, torch.full((rows, WORDS), -1, dtype=torch.int32)))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_compiled
def test_the_probe_refuses_another_summation_order(monkeypatch, caplog) -> None:
    """Told the wrong vector width (so its sums take another order), the library fails the
    probe against torch and stays off, with a warning naming what differed."""
    right, original = compiled._vector_width(), compiled._lib()
    wrong = 16 if right == 8 else 8
    monkeypatch.setattr(compiled, "_STATE", {})
    monkeypatch.setattr(compiled, "_vector_width", lambda: wrong)
    try:
        with caplog.at_level(logging.WARNING, logger=compiled.__name__):
            assert not compiled.available()
        assert "mass at" in caplog.text
        x = logits_of("normal", 2, 5000, 0, torch.bfloat16)
        assert compiled.compiled_tile_stats(x, np.arange(2), 5000, 4096) is None
    finally:  # (the process shares one loaded library: give it back its real width)
        compiled.configure(original, right)


@needs_compiled
@pytest.mark.parametrize("vocab", [1031, 40_000])
def test_the_repeated_driver_equals_reduce_torch_step_after_step(vocab) -> None:
    """The runtime's one-rank driver passes the same buffers every step and refills them in
    place: the prepared compiled call (reduce_torch_repeated) writes what reduce_torch writes,
    step after step, including steps with nothing requested, selected ids, tied rows left to
    the tile launch and an id outside the vocabulary (both handed back to Python)."""
    cap, width = 6, vocab + 5
    g = torch.Generator().manual_seed(vocab)
    logits = torch.zeros(cap, width, dtype=torch.bfloat16)
    ids, counts = pack_token_ids(None, cap, vocab)
    chosen = torch.zeros(cap, dtype=torch.int64)
    flags = torch.zeros(cap, dtype=torch.int32)
    request = RowRequest(chosen, ids, counts, flags, 20)
    out = torch.full((cap, WORDS), -1, dtype=torch.int32)
    for step in range(8):
        kind = ["normal", "ties"][step % 2]
        logits.copy_(logits_of(kind, cap, width, step, torch.bfloat16))
        chosen.copy_(torch.randint(0, vocab, (cap,), generator=g))
        flags.copy_((torch.rand(cap, generator=g) < 0.7).int() if step != 3 else 0)
        ids.fill_(-1)
        counts.zero_()
        if step % 3 == 1:
            ids[2, :3] = torch.tensor([vocab - 1, 0, 7])
            counts[2] = 3
        if step == 5:
            chosen[0], flags[0] = vocab + 2, 1  # a padding lane: left to the Python path
        expected = out.clone()
        reduce_torch(logits, request, vocab, expected)
        before = out.clone()
        call = compiled.repeated_call(logits, request, vocab, out, 4096, vocab < 4096)
        done = call is not None and call()
        if step in (0, 3):
            assert done, "a normal step completes in the compiled call"
        if step == 5:
            assert not done
        out.copy_(before)
        reduce_torch_repeated(logits, request, vocab, out)
        assert torch.equal(out, expected), step
