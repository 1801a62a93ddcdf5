"""Philox bits and the Gumbel-max searches of CPU rows in compiled code
(kernels/noise/philox.c, gumbel.c and sparse.c: one unit of the native extension,
kernels/noise/noise.c).

``native_bits(ids, position, k0, k1, out)`` writes the same int64 m = (w0 << 20) | (w1 >> 12)
as ``kernels.noise.philox.philox_bits`` (integer arithmetic only, so the bits are identical, not
merely close). ``native_gumbel_bounds`` is the same for kernels.noise.philox.gumbel_bounds
(float32, rounded as the torch path rounds it). ``native_candidates`` finds the few lanes of
each sampled row that can still win its Gumbel-max (ranks/sampler/gumbel.py scores them);
``native_sparse_best`` scores a sparse row's lanes itself, with torch's float64 log, and
``native_scaled_best`` a temperature-only row's candidates, read from its raw logits. Where
the package was built without the native extension (kernels/native.py), or with
``HELIOS_NATIVE=0``, ``available()`` is False and callers keep the torch path. Tests compare
both paths.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

import torch

from helios_logprobs.kernels.native import (
    VML_MODE,
    built_once,
    library,
    mkl_routine,
    parallel_threads,
)

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
"""state["lib"]: the extension, or None (tests set None to force the torch path);
state["log"]: _log_routines' answer, made on first use."""


def _build() -> ctypes.CDLL | None:
    return library()


def log_routines() -> tuple[int, int | None, int | None] | None:
    """_log_routines' answer, found once."""
    if "log" not in _STATE:
        with _LOCK:
            if "log" not in _STATE:
                _STATE["log"] = _log_routines()
    return _STATE["log"]


def _log_routines() -> tuple[int, int | None, int | None] | None:
    """(vmdLn, MKL's thread setters) when vmdLn in torch's mode gives torch's float64 log_ on
    this machine, word for word (uniforms of the sampler's kind at every length up to 80 and
    at offsets, and their noise's second log); else None (native_sparse_best then declines)."""
    routines = [mkl_routine(name) for name in
                ("vmdLn", "MKL_Set_Num_Threads_Local", "MKL_Get_Max_Threads")]
    if routines[0] is None:
        return None
    ln = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_longlong)(routines[0])
    m = torch.randint(0, 2**52, (4096,), generator=torch.Generator().manual_seed(5))
    m[:4] = torch.tensor([0, 1, 2**52 - 1, 2**51])
    u = m.to(torch.float64).add_(0.5).mul_(2.0**-52)
    for values in (u, u.log().neg_()):
        want = values.log()
        for start, end in [(0, n) for n in range(1, 81)] + [(3, 4096), (0, 4096)]:
            got = torch.empty(end - start, dtype=torch.float64)
            ln(end - start, values[start:end].data_ptr(), got.data_ptr(), VML_MODE)
            if not torch.equal(got.view(torch.int64), want[start:end].view(torch.int64)):
                return None
    return tuple(routines)


def _lib() -> ctypes.CDLL | None:
    return built_once(_STATE, _LOCK, _build)


def available() -> bool:
    return _lib() is not None


VECTOR_LEVELS = ("scalar", "avx2", "avx512")
"""philox.c's vector levels, in order: each takes the lanes the one after it leaves."""


def vector_level(cap: str = "avx512") -> str | None:
    """Caps the bits' vector level at `cap` (at most what this CPU has) and returns the level
    in use; None without the native library. Every level writes the same bits (tests take
    each one)."""
    lib = _lib()
    if lib is None:
        return None
    return VECTOR_LEVELS[lib.philox_vector_level(VECTOR_LEVELS.index(cap))]


def native_bits(token_ids: torch.Tensor, position: int, k0: int, k1: int,
                out: torch.Tensor) -> bool:
    """Fill out (int64, like token_ids) with philox_bits' m; False when not applicable (not
    CPU, not contiguous int64, or no native library): then nothing is written."""
    if (token_ids.device.type != "cpu" or out.device.type != "cpu"
            or token_ids.dtype != torch.int64 or out.dtype != torch.int64
            or not token_ids.is_contiguous() or not out.is_contiguous()
            or out.numel() != token_ids.numel()):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.philox_bits(token_ids.data_ptr(), token_ids.numel(), position & 0xFFFFFFFF,
                    k0 & 0xFFFFFFFF, k1 & 0xFFFFFFFF, out.data_ptr())
    return True


def native_bits_lanes(token_ids: torch.Tensor, position: torch.Tensor, k0: torch.Tensor,
                      k1: torch.Tensor, out: torch.Tensor) -> bool:
    """native_bits with one position and key pair per lane (int64 tensors shaped like
    token_ids, taken modulo 2**32); False when not applicable (nothing written)."""
    tensors = (token_ids, position, k0, k1, out)
    n = token_ids.numel()
    if not all(t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous()
               and t.numel() == n for t in tensors):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.philox_bits_lanes(*(t.data_ptr() for t in tensors[:4]), n, out.data_ptr())
    return True


def native_gumbel_bounds(m: torch.Tensor, c0: float, c1: float, out: torch.Tensor) -> bool:
    """out = c0 - c1 * float32 bits of float32(int32((m ^ (2**52 - 1)) >> 21)), as
    kernels.noise.philox.gumbel_bounds computes it; False when not applicable (nothing written)."""
    if (m.device.type != "cpu" or out.device.type != "cpu" or m.dtype != torch.int64
            or out.dtype != torch.float32 or not m.is_contiguous() or not out.is_contiguous()
            or out.numel() != m.numel()):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.gumbel_bounds(m.data_ptr(), m.numel(), c0, c1, out.data_ptr())
    return True


CANDIDATE_CAP = 512
"""Candidates a row may have in native_candidates before it is left to the caller's path."""

BLOCK_LANES = 128
"""philox.c's BLOCK: lanes per block maximum."""


class Candidates(NamedTuple):
    """native_candidates' answer: the rows it left (more than CANDIDATE_CAP candidates, or a
    largest value not finite or above x_limit in size: not searched), and every other row's
    candidates: the row of each, its lane, its bits (int64) and its value x (float32)."""

    left: list[int]
    owners: list[int]
    lanes: torch.Tensor
    bits: torch.Tensor
    values: torch.Tensor


def native_candidates(x: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int],
                      vocab_start: int, c0: float, c1: float, x_limit: float, threads: int,
                      temperatures: torch.Tensor | None = None) -> Candidates | None:
    """The lanes of rows `rows` of x (float32 [n, width], CPU, unit lane stride; ids below
    2**31) that can still win the row's Gumbel-max with its seed and position, with their
    bits and values (gumbel.c's gumbel_candidates says how they are found; c0 and c1 are
    gumbel_bounds' constants). Given `temperatures` (float32 [len(rows)]), x holds raw logits
    and each row's values are x / temperature, NaN as -inf, as the sampler's scratch would
    hold them. None when not applicable (nothing computed)."""
    search = _search(x, rows, seeds, positions, vocab_start, c0, c1, x_limit, threads,
                     temperatures)
    if search is None:
        return None
    found, lanes, bits, values = search
    left = [row for row, count in zip(rows, found, strict=True) if count < 0]
    owners, slots = [], []
    for k, count in enumerate(found):
        owners += [rows[k]] * max(count, 0)
        slots += range(k * CANDIDATE_CAP, k * CANDIDATE_CAP + count)
    index = torch.tensor(slots, dtype=torch.int64)
    return Candidates(left, owners, lanes.index_select(0, index), bits.index_select(0, index),
                      values.index_select(0, index))


def scores_candidates() -> bool:
    """Whether native_scaled_best can score candidates here (the native extension, and MKL's
    vmdLn giving torch's float64 log on this machine)."""
    lib = _lib()
    return lib is not None and log_routines() is not None


def native_scaled_best(x: torch.Tensor, rows: list[int], temperatures: torch.Tensor,
                       seeds: list[int], positions: list[int], vocab_start: int, c0: float,
                       c1: float, x_limit: float, threads: int
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Gumbel-max of rows `rows` of the raw logits x, divided by their temperatures (as
    native_candidates reads them), as (score key, global id) int64 [len(rows)]: the
    candidates scored in compiled code as the torch path scores them (sparse.c's
    score_candidates). None when not applicable: no native extension, no torch-exact log on this
    machine (scores_candidates), or a row the search leaves."""
    if not scores_candidates():
        return None
    lib = _lib()
    n_rows = len(rows)
    search = _search(x, rows, seeds, positions, vocab_start, c0, c1, x_limit, threads,
                     temperatures)
    if search is None or min(search[0]) <= 0:  # (every searched row holds its lead lane)
        return None
    found, lanes, bits, values = search
    counts = torch.tensor(found, dtype=torch.int64)
    key = torch.full((n_rows,), -(2**63), dtype=torch.int64)
    best_id = torch.full((n_rows,), 2**63 - 1, dtype=torch.int64)
    ln, set_local, get_max = log_routines()
    lib.score_candidates(counts.data_ptr(), n_rows, CANDIDATE_CAP, lanes.data_ptr(),
                         bits.data_ptr(), values.data_ptr(), vocab_start, ln, VML_MODE,
                         set_local, get_max, key.data_ptr(), best_id.data_ptr(),
                         max(1, min(threads, n_rows)))
    return key, best_id


def _search(x: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int],
            vocab_start: int, c0: float, c1: float, x_limit: float, threads: int,
            temperatures: torch.Tensor | None
            ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """gumbel_candidates over rows `rows`: each row's count (< 0: left) and the lanes, bits
    and values buffers, CANDIDATE_CAP slots per row."""
    n_rows = len(rows)
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or n_rows == 0):
        return None
    if temperatures is not None and (temperatures.dtype != torch.float32
                                     or tuple(temperatures.shape) != (n_rows,)
                                     or not temperatures.is_contiguous()):
        raise ValueError(f"temperatures: expected float32 [{n_rows}], got "
                         f"{temperatures.dtype} {tuple(temperatures.shape)}")
    lib = _lib()
    if lib is None:
        return None
    width = x.shape[1]
    keys = torch.tensor([rows, positions, seeds, [s >> 32 for s in seeds]], dtype=torch.int64)
    blocks = -(-width // BLOCK_LANES)
    jobs = max(n_rows, threads)
    maxima = torch.empty(n_rows * blocks, dtype=torch.float32)
    lead_value = torch.empty(jobs, dtype=torch.float32)
    lead_block = torch.empty(jobs, dtype=torch.int64)
    lead_x = torch.empty(jobs, dtype=torch.float32)
    counts = torch.empty(n_rows, dtype=torch.int64)
    lanes = torch.empty(n_rows * CANDIDATE_CAP, dtype=torch.int64)
    bits = torch.empty(n_rows * CANDIDATE_CAP, dtype=torch.int64)
    values = torch.empty(n_rows * CANDIDATE_CAP, dtype=torch.float32)
    row_ptr, pos_ptr, k0_ptr, k1_ptr = (keys[i].data_ptr() for i in range(4))
    lib.gumbel_candidates(
        x.data_ptr(), x.stride(0), row_ptr, n_rows, width, vocab_start, pos_ptr, k0_ptr,
        k1_ptr, None if temperatures is None else temperatures.data_ptr(), c0, c1, x_limit,
        maxima.data_ptr(), lead_value.data_ptr(), lead_block.data_ptr(), lead_x.data_ptr(),
        CANDIDATE_CAP, counts.data_ptr(), lanes.data_ptr(), bits.data_ptr(), values.data_ptr(),
        max(1, threads))
    return counts.tolist(), lanes, bits, values


def native_scaled_rows(src: torch.Tensor, temperatures: torch.Tensor, dst: torch.Tensor) -> bool:
    """dst = src with NaN as -inf, divided by each row's temperature (float32 [rows]): the
    sampler's scratch copy and division in one pass (both FP32 [rows, width] on the CPU with
    unit lane stride). False when not applicable (nothing written)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in
               (src, temperatures, dst)):
        return False
    if (src.dim() != 2 or src.shape != dst.shape or src.stride(1) != 1 or dst.stride(1) != 1
            or tuple(temperatures.shape) != (src.shape[0],)
            or not temperatures.is_contiguous()):
        return False
    lib = _lib()
    if lib is None:
        return False
    rows, width = src.shape
    lib.scaled_rows(src.data_ptr(), src.stride(0), rows, width, temperatures.data_ptr(),
                    dst.data_ptr(), dst.stride(0), parallel_threads(rows * width))
    return True


def native_cutoff_lanes(x: torch.Tensor, rows: list[int], low: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, lane) int64 of every lane of rows `rows` of x (FP32 [n, width], CPU, unit lane
    stride) with x >= low[row] (low: FP32 [n]), in row-major order: torch.nonzero(x[rows] >=
    low[rows, None]) with the rows' own indices. None when not applicable (nothing done)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or not rows or low.device.type != "cpu"
            or low.dtype != torch.float32):
        return None
    lib = _lib()
    if lib is None:
        return None
    n_rows, width = len(rows), x.shape[1]
    threads = parallel_threads(n_rows * width)
    index = torch.tensor(rows, dtype=torch.int64)
    cutoffs = low.index_select(0, index).contiguous()
    counts = torch.empty(n_rows, dtype=torch.int64)
    lib.cutoff_counts(x.data_ptr(), x.stride(0), index.data_ptr(), n_rows, width,
                      cutoffs.data_ptr(), counts.data_ptr(), threads)
    offsets = counts.cumsum(0) - counts
    total = int(counts.sum())
    row, lane = torch.empty(total, dtype=torch.int64), torch.empty(total, dtype=torch.int64)
    if total:
        lib.cutoff_lanes(x.data_ptr(), x.stride(0), index.data_ptr(), n_rows, width,
                         cutoffs.data_ptr(), offsets.data_ptr(), row.data_ptr(),
                         lane.data_ptr(), threads)
    return row, lane


def native_sparse_best(x: torch.Tensor, rows: list[int], low: torch.Tensor, seeds: torch.Tensor,
                       positions: torch.Tensor, vocab_start: int, best: torch.Tensor,
                       best_id: torch.Tensor) -> bool:
    """Folds each row of `rows` of x (FP32 [n, width], CPU, unit lane stride) into best and
    best_id (int64 [n]): every lane with x >= low[row] (FP32 [n]) scored float64(x) + noise
    of (seeds[row], positions[row], vocab_start + lane) as the torch path scores it (sparse.c
    says how). False when not applicable (nothing written)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or not rows or vocab_start + x.shape[1] > 2**31):
        return False
    inputs = ((low, torch.float32), (seeds, torch.int64), (positions, torch.int64),
              (best, torch.int64), (best_id, torch.int64))
    if not all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
               and t.shape == (x.shape[0],) for t, dtype in inputs):
        return False
    lib = _lib()
    if lib is None or log_routines() is None:
        return False
    ln, set_local, get_max = log_routines()
    n_rows, width = len(rows), x.shape[1]
    index = torch.tensor(rows, dtype=torch.int64)
    lib.sparse_best(x.data_ptr(), x.stride(0), index.data_ptr(), n_rows, width, low.data_ptr(),
                    positions.data_ptr(), seeds.data_ptr(), vocab_start, ln, VML_MODE,
                    set_local, get_max, best.data_ptr(), best_id.data_ptr(),
                    parallel_threads(n_rows * width))
    return True
