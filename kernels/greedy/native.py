"""The greedy pick of raw logit rows in compiled code (kernels/greedy/argmax.c).

``native_argmax(logits)`` returns int64 [rows]: ``torch.argmax(nan_to_num(logits, nan=-inf),
dim=1)``, the sampler's greedy rule, for FP32 or BF16 rows on the CPU, reading each row once
and writing no scratch copy (the torch path converts the rows into the sampler's FP32 scratch,
then takes its argmax: two passes and a write over [rows, vocabulary]). The integer answer is
exact, not close: maxima and equality are the only float operations. None (callers keep the
torch path) off x86-64 CPUs with AVX2, without a C compiler, on a failed build, for other
devices or dtypes, or with ``HELIOS_NATIVE_GREEDY=0``.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from helios_logprobs.kernels.native import (
    X86,
    built_once,
    load_library,
    parallel_threads,
    torch_openmp,
)

_SOURCE = (Path(__file__).parent / "argmax.c").read_text()
_FLAGS = ("-O3", "-fPIC", "-shared", "-mavx2")
_SWITCH = "HELIOS_NATIVE_GREEDY"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_ELEMENTS = {torch.float32: 4, torch.bfloat16: 2}


def _build() -> ctypes.CDLL | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None  # (built with -mavx2: it would stop on an illegal instruction)
    lib = None
    if torch_openmp():  # (rows fan out on torch's OpenMP threads)
        lib = load_library("greedy", _SOURCE, (*_FLAGS, "-fopenmp"), _SWITCH, machines=X86,
                           quiet=True)
    if lib is None:
        lib = load_library("greedy", _SOURCE, _FLAGS, _SWITCH, machines=X86)
    if lib is None:
        return None
    i64 = ctypes.c_int64
    lib.greedy_argmax.restype = None
    lib.greedy_argmax.argtypes = [ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64, i64,
                                  ctypes.c_void_p]
    return lib


def available() -> bool:
    return built_once(_STATE, _LOCK, _build) is not None


def native_argmax(logits: torch.Tensor, which: torch.Tensor | None = None) -> torch.Tensor | None:
    """First lane of each row's largest value (NaN as -inf; lane 0 for a row of -inf and NaN
    only), int64 [rows], of the rows `which` (int64 row indices, default every row) in that
    order; None where the compiled path does not apply."""
    lib = built_once(_STATE, _LOCK, _build)
    if (lib is None or logits.device.type != "cpu" or logits.dim() != 2
            or logits.dtype not in _ELEMENTS or logits.stride(1) != 1):
        return None
    rows, lanes = logits.shape
    if which is not None:
        if which.dtype != torch.int64 or which.dim() != 1 or which.device.type != "cpu":
            raise ValueError(f"which: expected int64 [rows] on the CPU, got {which.dtype} "
                             f"{tuple(which.shape)} on {which.device}")
        which = which.contiguous()
        if which.numel() and not (0 <= int(which.min()) and int(which.max()) < rows):
            raise ValueError(f"which: row indices must lie in [0, {rows})")
        rows = which.numel()
    out = torch.empty(rows, dtype=torch.int64)
    if rows and lanes:
        lib.greedy_argmax(logits.data_ptr(), _ELEMENTS[logits.dtype], logits.stride(0),
                          None if which is None else which.data_ptr(), rows, lanes,
                          parallel_threads(rows * lanes), out.data_ptr())
    else:
        out.zero_()
    return out
