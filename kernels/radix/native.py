"""The sampler's filters over CPU rows in compiled code (kernels/radix/radix.c): the radix
select of top-p and large top-k, each row's best k values, and the cuts.

``RadixLanes.start(x, row_max, scale)`` takes a block of FP32 rows and keeps, per row, its
lanes as (key, weight) pairs; ``histogram`` runs one round (drop the lanes
outside the bucket the previous round chose, then sum weights per bucket), ``below`` marks
the lanes under each row's cut and ``remove_below`` sets them to -inf. Keys, weights and sums
are those of the torch path (ranks/sampler/filters.py TorchRadixLanes), exactly: the weights'
exp is the MKL routine torch.exp calls. ``top_values`` is torch.topk's values, ``fill_below``
the cut at a key, ``fill_min_p`` min-p's cut. None or False (callers keep the torch path)
without MKL in this torch build, where the package was built without the native extension
(kernels/native.py), for other devices, dtypes or layouts, for rows whose maximum is not
finite (``start``), or with ``HELIOS_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
import math
import threading

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
"""state["lib"]: the extension, or None (no MKL, no extension; tests set None to force the
torch path); state["routines"]: (vmdExp, MKL's thread setters) for it."""


MAX_BITS = 7
"""Bits per round that radix.c's histograms hold (128 buckets)."""


KEPT_LANES = 1 << 22
"""Lanes whose buffers (12 bytes each: 48 MiB) a thread keeps between calls."""


class _Buffers(threading.local):
    """Per-thread keys and weights, reused up to KEPT_LANES (fresh large tensors page-fault on
    every call; larger blocks, such as 256 rows of 151,936 ids, get buffers of their own)."""

    def __init__(self) -> None:
        self.keys = torch.empty(0, dtype=torch.int32)
        self.weights = torch.empty(0, dtype=torch.int64)

    def take(self, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if lanes > KEPT_LANES:
            return torch.empty(lanes, dtype=torch.int32), torch.empty(lanes, dtype=torch.int64)
        if self.keys.numel() < lanes:
            self.keys = torch.empty(lanes, dtype=torch.int32)
            self.weights = torch.empty(lanes, dtype=torch.int64)
        return self.keys, self.weights


_BUFFERS = _Buffers()


def _build() -> ctypes.CDLL | None:
    routines = [mkl_routine(name) for name in
                ("vmdExp", "MKL_Set_Num_Threads_Local", "MKL_Get_Max_Threads")]
    if routines[0] is None:
        return None
    _STATE["routines"] = tuple(routines)
    return library()


def available() -> bool:
    return built_once(_STATE, _LOCK, _build) is not None


def _takes(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library, where x is rows it can read: FP32 [rows, width], CPU, unit lane stride."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or not x.numel()):
        return None
    return built_once(_STATE, _LOCK, _build)


def top_values(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """torch.topk(x, k, dim=1).values (FP32 [rows, k], largest first) of NaN-free rows;
    None where compiled code does not apply (the caller keeps torch.topk)."""
    lib = _takes(x)
    if lib is None or not 1 <= k <= x.shape[1]:
        return None
    rows, width = x.shape
    out = torch.empty(rows, k, dtype=torch.float32)
    lib.radix_top_values(x.data_ptr(), x.stride(0), rows, width, k, out.data_ptr(),
                         parallel_threads(rows * width))
    return out


def fill_below(x: torch.Tensor, cut: torch.Tensor) -> bool:
    """x[r, i] = -inf where value_keys(x[r, i]) < cut[r] (int64 keys in [0, 2**32); a cut of 0
    leaves the row), in place; False where compiled code does not apply (nothing done)."""
    lib = _takes(x)
    if lib is None:
        return False
    rows, width = x.shape
    cut = cut.to(device="cpu", dtype=torch.int64).contiguous()
    lib.radix_fill_below(x.data_ptr(), x.stride(0), rows, width, cut.data_ptr(),
                         parallel_threads(rows * width))
    return True


def fill_min_p(x: torch.Tensor, row_max: torch.Tensor, floors: torch.Tensor,
               checked: bool = False) -> bool:
    """x[r, i] = -inf where relative_probs(x, row_max)[r, i] < floors[r] (floors in (0, 1]),
    in place, with torch's float64 exp where the test is close (radix.c says how); False
    where compiled code does not apply (nothing done). checked: the caller built floors
    from values it checked (RowSampling.min_p), so they are not read back here."""
    lib = _takes(x)
    if lib is None:
        return False
    rows, width = x.shape
    maxima = row_max.to(device="cpu", dtype=torch.float64).contiguous()
    floors = floors.to(device="cpu", dtype=torch.float64).contiguous()
    if maxima.shape != (rows,) or floors.shape != (rows,):
        raise ValueError(f"fill_min_p: row_max and floors must be [{rows}]")
    if not checked and not bool(((floors > 0) & (floors <= 1)).all()):
        raise ValueError("fill_min_p: floors must lie in (0, 1]")
    exp, set_local, get_max = _STATE["routines"]
    lib.radix_min_p(x.data_ptr(), x.stride(0), rows, width, maxima.data_ptr(),
                    floors.data_ptr(), exp, VML_MODE, set_local, get_max,
                    parallel_threads(rows * width))
    return True


class RadixLanes:
    """One block's lanes, held in compiled code between rounds."""

    def __init__(self, lib: ctypes.CDLL, x: torch.Tensor, keys: torch.Tensor,
                 weights: torch.Tensor, counts: torch.Tensor) -> None:
        self.lib, self.x, self.keys, self.weights, self.counts = lib, x, keys, weights, counts

    @classmethod
    def start(cls, x: torch.Tensor, row_max: torch.Tensor | None,
              scale: float) -> RadixLanes | None:
        """x: FP32 [rows, width] on the CPU with unit lane stride. row_max None: unit
        weights; else probability weights floor(exp(x - row_max) * scale). The lanes live in
        the thread's buffers: valid until the thread's next start."""
        lib = _takes(x)
        if lib is None:
            return None
        maxima = None
        if row_max is not None:
            maxima = row_max.to(device="cpu", dtype=torch.float64).contiguous()
            if not all(math.isfinite(m) for m in maxima.tolist()):
                return None
        rows, width = x.shape
        keys, weights = _BUFFERS.take(rows * width)
        counts = torch.empty(rows, dtype=torch.int64)
        exp, set_local, get_max = _STATE["routines"]
        lib.radix_start(x.data_ptr(), x.stride(0), rows, width,
                        None if maxima is None else maxima.data_ptr(), scale,
                        None if maxima is None else exp, VML_MODE, set_local, get_max,
                        keys.data_ptr(), weights.data_ptr(), counts.data_ptr(),
                        parallel_threads(rows * width))
        return cls(lib, x, keys, weights, counts)

    def histogram(self, shift: int, bits: int,
                  previous: tuple[int, int, torch.Tensor] | None) -> torch.Tensor:
        """int64 [rows, 2**bits]: the weight in each bucket of bits [shift, shift + bits) of
        the lanes left, after dropping those outside previous = (shift, bits, chosen bucket
        per row) of the round before."""
        if not 0 < bits <= MAX_BITS or not 0 <= shift <= 32 - bits:
            raise ValueError(f"radix round: bits {bits} at shift {shift} outside 1..{MAX_BITS}"
                             " bits of a 32-bit key")
        rows, width = self.x.shape
        hist = torch.empty(rows, 1 << bits, dtype=torch.int64)
        keep_shift, keep_bits, chosen = previous if previous is not None else (0, 0, None)
        if chosen is not None:
            chosen = chosen.to(device="cpu", dtype=torch.int64).contiguous()
        self.lib.radix_round(self.keys.data_ptr(), self.weights.data_ptr(),
                             self.counts.data_ptr(), rows, width, keep_shift, keep_bits,
                             None if chosen is None else chosen.data_ptr(), shift, bits,
                             hist.data_ptr(), parallel_threads(rows * width))
        return hist

    def below(self, cut: torch.Tensor) -> torch.Tensor:
        """bool [rows, width]: lanes whose key is below their row's cut."""
        rows, width = self.x.shape
        cut = cut.to(device="cpu", dtype=torch.int64).contiguous()
        out = torch.empty(rows, width, dtype=torch.bool)
        self.lib.radix_below(self.x.data_ptr(), self.x.stride(0), rows, width, cut.data_ptr(),
                             out.data_ptr(), parallel_threads(rows * width))
        return out

    def remove_below(self, block: torch.Tensor, cut: torch.Tensor) -> None:
        """Set block's lanes whose key is below their row's cut to -inf, in place (block: the
        rows this started on), in one compiled pass."""
        x = self.x
        if (block.data_ptr(), block.shape, block.stride()) != (x.data_ptr(), x.shape, x.stride()):
            raise ValueError("remove_below: block is not the rows these lanes started on")
        fill_below(x, cut)
