"""The CPU reduction's launches 1-3 in compiled code (compiled.c), bit for bit the torch ones.

Why compiled: in torch, launch 1 costs about five tensor calls per slab and a one-row call
at vocabulary 32,000 is eight slabs, so the fixed cost of the launches (each tensor or numpy
call costs microseconds here) exceeded a whole ``log_softmax``. Here one C call per launch
walks the flagged rows (several threads for large calls). Launch 1 goes tile by tile with
one tile of FP32 scratch (16 KiB at 4,096 lanes; no slab, no [rows, vocabulary] copy):

1. Convert the tile's lanes to FP32 (exact), tracking the strided chunk maxima (chunk j of
   a tile = lanes j, j + tile/16, ...; the tail tile's chunks likewise over its body) and the
   tile maximum; any NaN lane makes its chunk and tile maximum NaN.
2. Shift by the tile maximum (by 0 when it is -inf), then exp through the same MKL routine
   torch's ``exp_`` calls (``vmsExp``, high-accuracy mode, lane by lane independent).
3. Sum the tile in torch's order: ``cascade_sum``'s contiguous inner reduction (vectors of
   the sum kernel's width, ``_vector_width``; four interleaved accumulators, four cascade
   levels, scalar tail, then the vector's lanes in order); under a vector's width, its
   scalar ``row_sum``.
4. Rows too narrow for launch 3's chunk prefilter also keep their CANDIDATES largest raw
   values (ties broken arbitrarily) and the largest value left out, as launch 3's
   candidates.

Launch 2 (``compiled_lse``) is lean_lse's arithmetic with the same exp, log and sum; launch 3
(``compiled_best``) is lean.py's rank_candidates over the same candidates, comparisons and
one subtraction per lane, and reports which rows it can vouch for (the others take the
tile-by-tile launch 3, as before). The shard steps call these three; the one-rank path calls
``compiled_reduce``, which runs them and writes the packed payload in a single C call.
Prompt scoring's rank count (``compiled_count_above``, count.c) is one more pass of the same
kind: one subtraction and one comparison per lane.

Every FP32 value is therefore the torch path's. Because that equality rests on torch's
internals (the exp and log routines, the summation order), the library is used only after a
probe on this machine compares launches 1 and 2 with ``tile_stats`` and ``normalization``
word for word (maxima with -0.0 read as +0.0, masses, chunk maxima, lse) over shapes that
reach every branch; a mismatch, a torch build without MKL's ``vmsExp``/``vmsLn``, a CPU
capability other than AVX2/AVX512, a package built without the native extension
(kernels/native.py), or ``HELIOS_NATIVE=0`` leaves the torch path in place.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict

import numpy as np
import torch

from helios_logprobs.kernels.cpu import exp_check
from helios_logprobs.kernels.cpu.tiles import (
    CHUNK_LANES,
    TileStats,
    normalization,
    tile_stats,
)
from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.layout import TILE_CANDIDATES as TOP
from helios_logprobs.kernels.native import (
    PARALLEL_LANES,
    VML_MODE,
    built_once,
    library,
    mkl_routine,
)

_LOG = logging.getLogger(__name__)

_EXP_SWITCH = "HELIOS_EMULATED_EXP"


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


Picks = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]
"""Launch 3's candidates of narrow rows: lanes int64 [n, c] (row-relative), their raw FP32
values [n, c], and the largest raw value left out FP32 [n, 1] (None when every lane is a
candidate)."""


def _vector_width() -> int | None:
    """Floats per vector in torch's CPU sum kernel, read off one sum: None off AVX2/AVX512.

    Not the capability's ``Vectorized<float>`` width: torch registers its sum kernel with
    REGISTER_DISPATCH, which gives an AVX512 capability the AVX2 build (8 lanes), as seen on
    a Sapphire Rapids CPU. Lanes 0 and 8 are 2^24 and -2^24, lane 1 is 1: two 8-lane vectors
    add lane-wise first (0, 1, ...) and sum to 1; one 16-lane vector sums its lanes in
    order, where 2^24 + 1 rounds back to 2^24, and gives 0."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    x = torch.zeros(16, dtype=torch.float32)
    x[0], x[1], x[8] = 2.0**24, 1.0, -(2.0**24)
    return {1.0: 8, 0.0: 16}.get(float(x.sum()))


def _build() -> ctypes.CDLL | None:
    width, exp, log = _vector_width(), mkl_routine("vmsExp"), mkl_routine("vmsLn")
    if width is None or exp is None or log is None:
        return None
    lib = library()
    if lib is None or not lib.reduction_supported():  # (its code is built for AVX2)
        return None
    configure(lib, width)
    failed = _probe(lib)
    _KEPT.outputs.clear()
    if failed:
        _LOG.warning("native tile statistics differ from torch's (%s); using the torch path",
                     failed)
        return None
    return lib


def configure(lib: ctypes.CDLL, width: int) -> None:
    """Hands the library torch's MKL exp and log, the MKL thread controls (None: MKL threads
    as configured) and the vector width its sums take, and turns exp_lanes.c's exp on where
    it may be (HELIOS_EMULATED_EXP=0 keeps vmsExp)."""
    lib.configure(mkl_routine("vmsExp"), mkl_routine("vmsLn"),
                  mkl_routine("MKL_Set_Num_Threads_Local"), mkl_routine("MKL_Get_Max_Threads"),
                  VML_MODE, width)
    set_emulated_exp(lib, os.environ.get(_EXP_SWITCH, "1") != "0")


def set_emulated_exp(lib: ctypes.CDLL, on: bool) -> bool:
    """Turns exp_lanes.c's copy of torch's FP32 exp on or off; on only where the CPU has
    AVX-512F and exp_check's probe finds torch.exp's words. Returns whether it is on."""
    vexp = mkl_routine("vmsExp")
    if not lib.use_emulated_exp(vexp, VML_MODE, int(on)):
        return False
    if lib._handle not in _EXP_PROBED:
        _EXP_PROBED[lib._handle] = exp_check.differs(lib)
        if _EXP_PROBED[lib._handle]:
            _LOG.info("torch.exp here is not the MKL kernel exp_lanes.c repeats (%s); the "
                      "reduction calls vmsExp", _EXP_PROBED[lib._handle])
    if _EXP_PROBED[lib._handle]:
        lib.use_emulated_exp(vexp, VML_MODE, 0)
        return False
    return True


_EXP_PROBED: dict[int, str] = {}
"""exp_check's verdict per loaded library: the probe runs once."""


def emulated_exp() -> bool:
    """Whether the compiled reduction takes exp_lanes.c's exp in this process."""
    lib = _lib()
    return lib is not None and bool(lib.emulated_exp_on())


def _lib() -> ctypes.CDLL | None:
    return built_once(_STATE, _LOCK, _build)


def available() -> bool:
    return _lib() is not None


def supports(logits: torch.Tensor) -> bool:
    """Whether these logits can take the compiled launch 1 (CPU, bf16 or FP32 rows of unit
    lane stride)."""
    return (logits.device.type == "cpu" and logits.dim() == 2
            and logits.dtype in (torch.bfloat16, torch.float32)
            and (logits.stride(1) == 1 or logits.shape[1] <= 1))


def compiled_tile_stats(
    logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int, cap: int = 0
) -> tuple[TileStats, Picks | None] | None:
    """Launch 1 (tile_stats, bit for bit) on rows `rows` of `logits`, and with cap > 0 each
    row's `cap` largest raw values (Picks); None when the compiled path does not apply."""
    if not supports(logits):
        return None
    lib = _lib()
    if lib is None:
        return None
    return _run(lib, logits, rows, valid, tile, cap)


def compiled_count_above(logits: torch.Tensor, valid: int, lse: np.ndarray,
                         value: np.ndarray) -> np.ndarray | None:
    """int64 [rows]: per row of `logits`, the lanes below `valid` whose reported value
    fp32(x) - lse exceeds `value` strictly (count.c); None when the compiled path does not
    apply. lse and value: FP32 [rows]."""
    if not supports(logits):
        return None
    lib = _lib()
    if lib is None:
        return None
    n = logits.shape[0]
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    value = np.ascontiguousarray(value, dtype=np.float32)
    out = np.empty(n, np.int64)
    threads = torch.get_num_threads() if n > 1 and n * valid >= PARALLEL_LANES else 1
    lib.count_above(logits.data_ptr(), logits.element_size(), logits.stride(0), n, valid,
                    lse.ctypes.data, value.ctypes.data, out.ctypes.data, threads)
    return out


class _Outputs:
    """One shape's outputs and their views, kept per thread between calls (a view costs
    microseconds here): the next call with the same shape on the same thread overwrites
    them, as kernels/cpu/lean_stats.py's StatsPlan does."""

    def __init__(self, n: int, valid: int, tile: int, cap: int) -> None:
        full, rest = divmod(valid, tile)
        per, tiles = tile // CHUNK_LANES, full + (rest > 0)
        chunks = full * per + rest // CHUNK_LANES
        words = torch.empty(n * (chunks + 2 * tiles), dtype=torch.float32)
        flat = words[: n * chunks].view(n, chunks)
        tmax = words[n * chunks : n * (chunks + tiles)].view(n, tiles)
        tmass = words[n * (chunks + tiles) :].view(n, tiles)
        self.stats = TileStats(tmax, tmass, flat[:, : full * per].view(n, full, per),
                               flat[:, full * per :])
        keep = min(cap, valid)
        self.every = keep == valid
        self.lanes = np.empty((n, keep), np.int64)
        self.raw = np.empty((n, keep), np.float32)
        self.bound = np.empty(n, np.float32)
        self.flat_ptr = flat.data_ptr()
        self.lse = np.empty(n, np.float32)
        self.redo = np.empty(n, np.uint8)
        self.lse_ptr, self.redo_ptr = self.lse.ctypes.data, self.redo.ctypes.data
        """compiled_reduce's launch 2 and redo flags, overwritten like the stats."""
        self.args = (n, valid, tile, flat.data_ptr(), tmax.data_ptr(), tmass.data_ptr(), keep,
                     self.lanes.ctypes.data, self.raw.ctypes.data, self.bound.ctypes.data)


class _Kept(threading.local):
    def __init__(self) -> None:
        self.outputs: OrderedDict[tuple[int, int, int, int], _Outputs] = OrderedDict()


_KEPT = _Kept()
OUTPUTS_KEPT = 4


def _outputs(n: int, valid: int, tile: int, cap: int) -> _Outputs:
    key = (n, valid, tile, cap)
    kept = _KEPT.outputs
    out = kept.get(key)
    if out is None:
        out = kept[key] = _Outputs(n, valid, tile, cap)
        while len(kept) > OUTPUTS_KEPT:
            kept.popitem(last=False)
    else:
        kept.move_to_end(key)
    return out


def _run(lib: ctypes.CDLL, logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int,
         cap: int, threads: int | None = None) -> tuple[TileStats, Picks | None]:
    if tile % CHUNK_LANES or tile < CHUNK_LANES:
        raise ValueError(f"tile {tile} must be a positive multiple of {CHUNK_LANES}")
    if rows.dtype != np.int64 or not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    n = rows.size
    out = _outputs(n, valid, tile, cap)
    if threads is None:
        threads = torch.get_num_threads() if n > 1 and n * valid >= PARALLEL_LANES else 1
    lib.tile_stats(logits.data_ptr(), logits.element_size(), logits.stride(0), rows.ctypes.data,
                   *out.args, threads)
    if not cap:
        return out.stats, None
    if out.every:  # every lane is a candidate: in lane order, no bound
        order = np.argsort(out.lanes, axis=1)
        return out.stats, (np.take_along_axis(out.lanes, order, 1),
                           np.take_along_axis(out.raw, order, 1), None)
    return out.stats, (out.lanes.copy(), out.raw.copy(), out.bound[:, None].copy())


def compiled_reduce(
    logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int, chosen: np.ndarray,
    counts: np.ndarray, selected: np.ndarray, k: int, narrow: bool, out: torch.Tensor,
) -> tuple[np.ndarray, TileStats, np.ndarray] | None:
    """The whole one-rank reduction of rows `rows` into their payload rows of `out`
    (reduce_rows in compiled.c): None when the compiled path does not apply (nothing
    written); else (redo uint8 [n], launch 1's stats, lse [n]) where redo is 1 for natural
    rows whose best K the caller must still decide (their pairs are -1) and 2 for rows with
    an id outside the vocabulary (the caller must redo the call). `chosen` int64, `counts`
    int32 and `selected` int32 [rows, 128] are indexed by row like `out`; `narrow`: launch 3
    takes launch 1's picks (lean_stats.uses_chunks is False). The three arrays returned are
    kept per thread and overwritten by the next call of the same shape, as _Outputs says."""
    if (not supports(logits) or out.dtype != torch.int32 or not out.is_contiguous()
            or out.dim() != 2 or out.shape[1] != PAYLOAD_WORDS):
        return None
    lib = _lib()
    if lib is None:
        return None
    n = rows.size
    kept = _outputs(n, valid, tile, 0)
    threads = torch.get_num_threads() if n > 1 and n * valid >= PARALLEL_LANES else 1
    stats = kept.stats
    lib.reduce_rows(logits.data_ptr(), logits.element_size(), logits.stride(0), rows.ctypes.data,
                    n, valid, tile, chosen.ctypes.data, counts.ctypes.data, selected.ctypes.data,
                    k, min(k, TOP, valid), int(narrow), kept.flat_ptr, stats.max.data_ptr(),
                    stats.mass.data_ptr(), kept.lse_ptr, out.data_ptr(), kept.redo_ptr, threads)
    return kept.redo, stats, kept.lse


class _FlaggedCall(ctypes.Structure):
    """reduce_prepared's argument block (FlaggedCall in compiled.c, field for field)."""

    _fields_ = [(name, ctypes.c_void_p if kind == "p" else ctypes.c_int64) for name, kind in (
        ("base", "p"), ("elem", "i"), ("row_stride", "i"), ("flags", "p"), ("total", "i"),
        ("valid", "i"), ("tile", "i"), ("chosen", "p"), ("counts", "p"), ("sel", "p"),
        ("k", "i"), ("m", "i"), ("narrow", "i"), ("cmax", "p"), ("tmax", "p"), ("tmass", "p"),
        ("lse", "p"), ("out", "p"), ("redo", "p"), ("parallel_lanes", "i"), ("rows_out", "p"),
        ("flagged", "p"))]


class RepeatedCall:
    """compiled_reduce bound to buffers its caller passes again on every call (the runtime's
    one-rank driver: the same logits buffer, RowRequest and payload each step). Every argument
    is prepared once in a FlaggedCall block; a call is one C call that reads the requested
    flags itself. ``function`` and ``block`` are the C entry's address and its argument
    block's, for a C caller (ranks/step/gate.c): ``function(block, threads)`` returns the
    number of rows left for the Python path."""

    def __init__(self, lib: ctypes.CDLL, logits: torch.Tensor, request, valid: int,
                 out: torch.Tensor, tile: int, narrow: bool) -> None:
        total = out.shape[0]
        self.lib, self.keep = lib, (logits, request, out)  # (alive: the pointers stay valid)
        self.logits_ptr = logits.data_ptr()
        full, rest = divmod(valid, tile)
        chunks, tiles = full * (tile // CHUNK_LANES) + rest // CHUNK_LANES, full + (rest > 0)
        self.scratch = np.empty(total * (chunks + 2 * tiles), np.float32)
        """Launch 1's chunk maxima, tile maxima and tile masses [total, ...] (host C scratch,
        like lse and redo: nothing outside the C call reads them)."""
        flat, tmax, tmass = (self.scratch.ctypes.data + 4 * total * offset
                             for offset in (0, chunks, chunks + tiles))
        self.lse = np.empty(total, np.float32)
        self.redo = np.empty(total, np.uint8)
        self.rows = np.empty(total, np.int64)
        self.flagged = np.zeros(1, np.int64)
        k = request.k
        self.call = _FlaggedCall(
            logits.data_ptr(), logits.element_size(), logits.stride(0),
            request.requested.data_ptr(), total, valid, tile, request.chosen.data_ptr(),
            request.counts.data_ptr(), request.ids.data_ptr(), k, min(k, TOP, valid),
            int(narrow), flat, tmax, tmass, self.lse.ctypes.data, out.data_ptr(),
            self.redo.ctypes.data, PARALLEL_LANES, self.rows.ctypes.data,
            self.flagged.ctypes.data)
        self.block = ctypes.addressof(self.call)
        self.function = ctypes.cast(lib.reduce_prepared, ctypes.c_void_p).value

    def __call__(self) -> bool:
        """Whether the call completed (False: rows are left for the Python path)."""
        return self.lib.reduce_prepared(self.block, torch.get_num_threads()) == 0


class _RepeatedKept(threading.local):
    def __init__(self) -> None:
        self.calls: OrderedDict[tuple, RepeatedCall] = OrderedDict()


_REPEATED = _RepeatedKept()


def repeated_call(logits: torch.Tensor, request, valid: int, out: torch.Tensor, tile: int,
                  narrow: bool) -> RepeatedCall | None:
    """This thread's prepared call for these buffers, for a caller that passes the same
    buffers every call (made on first use), or None when the compiled launches do not apply
    to them. Calling it returns True when the payload rows are written, False when some row
    is left to the caller's own path. `narrow`: launch 3 takes launch 1's picks
    (lean_stats.uses_chunks is False)."""
    key = (id(logits), id(request), id(out), valid, tile)
    kept = _REPEATED.calls
    call = kept.get(key)
    if call is None or call.logits_ptr != logits.data_ptr():
        lib = _lib()
        if lib is None or not _repeatable(logits, request, out):
            return None
        call = kept[key] = RepeatedCall(lib, logits, request, valid, out, tile, narrow)
        while len(kept) > OUTPUTS_KEPT:
            kept.popitem(last=False)
    return call


def _repeatable(logits: torch.Tensor, request, out: torch.Tensor) -> bool:
    total = out.shape[0]
    wanted = ((request.chosen, torch.int64, (total,)),
              (request.counts, torch.int32, (total,)),
              (request.requested, torch.int32, (total,)),
              (request.ids, torch.int32, (total, MAX_TOKEN_IDS)),
              (out, torch.int32, (total, PAYLOAD_WORDS)))
    return supports(logits) and logits.shape[0] == total and all(
        t.device.type == "cpu" and t.dtype == dtype and tuple(t.shape) == shape
        and t.is_contiguous() for t, dtype, shape in wanted)


def compiled_lse(stats: TileStats) -> tuple[np.ndarray, bool] | None:
    """Launch 2: (FP32 lse [n], all finite), lean_lse's bits; None without the library."""
    lib = _lib()
    if lib is None:
        return None
    return _lse(lib, stats)


def _lse(lib: ctypes.CDLL, stats: TileStats) -> tuple[np.ndarray, bool]:
    tmax, tmass = stats.max, stats.mass
    if not (tmax.is_contiguous() and tmass.is_contiguous()):
        tmax, tmass = tmax.contiguous(), tmass.contiguous()
    n, tiles = tmax.shape
    out = np.empty((3, n), np.float32)
    lib.row_lse(tmax.data_ptr(), tmass.data_ptr(), n, tiles, out[0].ctypes.data,
                out[1].ctypes.data, out[2].ctypes.data)
    lse = out[2]
    return lse, bool(np.isfinite(lse).all())


def compiled_best(
    logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int, stats: TileStats,
    picks: Picks | None, lse: np.ndarray, m: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Launch 3 on rows `rows` (lean.py's rank_candidates over chunk candidates, or over
    `picks` for narrow rows): (ids int64 [n, m] row-relative, values FP32 [n, m], exact bool
    [n]); only rows with exact set hold their best m. None without the library."""
    lib = _lib()
    if lib is None or not supports(logits):
        return None
    if rows.dtype != np.int64 or not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    n = rows.size
    ids = np.empty((n, m), np.int64)
    values = np.empty((n, m), np.float32)
    exact = np.empty(n, np.uint8)
    cmax = tail = None
    picked, lanes, raw, bound = 0, None, None, None
    if picks is None:
        cmax, tail = stats.chunk_max, stats.tail_max
        if cmax.stride(-1) != 1 or (cmax.shape[1] > 1 and cmax.stride(1) != cmax.shape[2]):
            cmax = cmax.contiguous()
        if tail.shape[1] and tail.stride(-1) != 1:
            tail = tail.contiguous()
    else:
        lanes = np.ascontiguousarray(picks[0], dtype=np.int64)
        raw = np.ascontiguousarray(picks[1], dtype=np.float32)
        bound = None if picks[2] is None else np.ascontiguousarray(picks[2][:, 0])
        picked = lanes.shape[1]
    lib.best_lanes(
        logits.data_ptr(), logits.element_size(), logits.stride(0), rows.ctypes.data, n, valid,
        tile, None if cmax is None else cmax.data_ptr(),
        0 if cmax is None else cmax.stride(0), None if tail is None else tail.data_ptr(),
        0 if tail is None else tail.stride(0), None if lanes is None else lanes.ctypes.data,
        None if raw is None else raw.ctypes.data, None if bound is None else bound.ctypes.data,
        picked, lse.ctypes.data, m, ids.ctypes.data, values.ctypes.data, exact.ctypes.data)
    return ids, values, exact.view(bool)


def _probe(lib: ctypes.CDLL) -> str:
    """'' when the compiled launches 1 and 2 equal tile_stats and normalization word for
    word on inputs that reach every branch (tails under and over a vector's width,
    chunkless tiles, NaN, +-inf, -inf rows, -0.0, row subsets, several threads); else what
    differed."""
    gen = torch.Generator().manual_seed(1234)
    cases = [(3, 423, 4096), (2, 4096, 4096), (2, 4099, 4096), (2, 4103, 4096),
             (2, 8193, 4096), (3, 1031, 64), (2, 37, 16), (2, 5, 16), (1, 32000, 4096),
             (5, 20011, 4096)]
    for dtype in (torch.bfloat16, torch.float32):
        for n, valid, tile in cases:
            x = torch.randn(n + 1, valid + 3, generator=gen) * 4
            if n > 1:
                x[1, ::7] = float("-inf")
                x[1, 3] = -0.0
                x[2 % (n + 1), :] = float("-inf")
            if n > 2:
                x[3, valid // 2] = float("nan")
                x[0, valid - 1] = float("inf")
            x = x.to(dtype)
            rows = np.arange(n)[::-1].copy()
            for threads in (1, 2):
                got, _ = _run(lib, x, rows, valid, tile, 0, threads)
                want = tile_stats(x, torch.from_numpy(rows), valid, tile)
                where = f"{dtype}, rows {n}, lanes {valid}, tile {tile}"
                for name, a, b in zip(TileStats._fields, got, want, strict=True):
                    if not _same(a, b):
                        return f"{name} at {where}"
                if not _same(torch.from_numpy(_lse(lib, got)[0]), normalization(want)):
                    return f"lse at {where}"
    return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal words, -0.0 read as +0.0 and any NaN as any NaN."""
    if a.shape != b.shape:
        return False
    a, b = a.contiguous() + 0.0, b.contiguous() + 0.0
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())
                and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))
