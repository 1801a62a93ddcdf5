"""The greedy pick of raw logit rows in compiled code (kernels/greedy/argmax.c).

``native_argmax(logits)`` returns int64 [rows]: ``torch.argmax(nan_to_num(logits, nan=-inf),
dim=1)``, the sampler's greedy rule, for FP32 or BF16 rows on the CPU, reading each row once
and writing no scratch copy (the torch path converts the rows into the sampler's FP32 scratch,
then takes its argmax: two passes and a write over [rows, vocabulary]). The integer answer is
exact, not close: maxima and equality are the only float operations. Eight lanes at a time
where the CPU has AVX2, else a scalar loop (``vector_level`` caps it; both give the same
answer). None (callers keep the torch path) for other devices or dtypes, where the package was
built without the native extension (kernels/native.py), or with ``HELIOS_NATIVE=0``.
"""

from __future__ import annotations

import threading

import torch

from helios_logprobs.kernels.native import built_once, library, parallel_threads

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_ELEMENTS = {torch.float32: 4, torch.bfloat16: 2}


def available() -> bool:
    return built_once(_STATE, _LOCK, library) is not None


VECTOR_LEVELS = ("scalar", "avx2")
"""argmax.c's vector levels, in order."""


def vector_level(cap: str = "avx2") -> str | None:
    """Caps the pick's vector level at `cap` (at most what this CPU has) and returns the level
    in use; None without the native library."""
    lib = built_once(_STATE, _LOCK, library)
    if lib is None:
        return None
    return VECTOR_LEVELS[lib.greedy_vector_level(VECTOR_LEVELS.index(cap))]


def native_argmax(logits: torch.Tensor, which: torch.Tensor | None = None,
                  checked: bool = False) -> torch.Tensor | None:
    """First lane of each row's largest value (NaN as -inf; lane 0 for a row of -inf and NaN
    only), int64 [rows], of the rows `which` (int64 row indices, default every row) in that
    order; None where the compiled path does not apply. checked: the caller built `which`
    from row numbers it checked, so its values are not read back here."""
    lib = built_once(_STATE, _LOCK, library)
    if (lib is None or logits.device.type != "cpu" or logits.dim() != 2
            or logits.dtype not in _ELEMENTS or logits.stride(1) != 1):
        return None
    rows, lanes = logits.shape
    if which is not None:
        if which.dtype != torch.int64 or which.dim() != 1 or which.device.type != "cpu":
            raise ValueError(f"which: expected int64 [rows] on the CPU, got {which.dtype} "
                             f"{tuple(which.shape)} on {which.device}")
        which = which.contiguous()
        if not checked and which.numel() and not (
                0 <= int(which.min()) and int(which.max()) < rows):
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
