"""The native CPU kernels: one extension module, built at install, bound here with ctypes.

Every C source of the package compiles once, when the package is built (``pip install``,
``pip install -e``, ``pip wheel``), into one shared object, ``helios_logprobs.kernels._native``
(pyproject.toml's ext-modules); no compiler runs while serving. ``library()`` finds it
(``importlib.util.find_spec``), loads it once and declares every exported function's signature
from SIGNATURES; the loaders (kernels/cpu/compiled.py, kernels/noise/philox_native.py,
kernels/greedy/native.py, kernels/radix/native.py, ranks/step/gate_native.py) take the handle
from here and add their own checks (probes, CPU features, MKL routines).

``library()`` is None, and every native path reports unavailable (callers keep their torch
paths, which give the same bits), where the package was built without a C compiler (the
extension is optional) or with ``HELIOS_NATIVE=0``. ``absence()`` says which, in the one line
the server prints at start-up.

OpenMP, one decision (made at build time): the extension is built with -fopenmp and needs
libgomp.so.1, the soname of the libgomp that torch's Linux wheels ship in torch/lib and load
with libtorch_cpu. ``_load`` imports torch first, so the dynamic loader reuses torch's copy: the
threaded loops run on torch's own OpenMP team (tests/unit/kernels/test_native_build.py checks
that one libgomp is mapped, torch's). A torch built with another OpenMP runtime still works; the
extension's loops then start a pool of their own.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

_LOG = logging.getLogger(__name__)

EXTENSION = "helios_logprobs.kernels._native"
SWITCH = "HELIOS_NATIVE"
"""HELIOS_NATIVE=0 turns every native path off (tests use it to force the torch paths)."""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _F64, _LL, _U32 = ctypes.c_float, ctypes.c_double, ctypes.c_longlong, ctypes.c_uint32

SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    # name: (restype, argtypes). The C definitions are the reference; a test compares them.
    # kernels/cpu/reduction.c (exp_lanes.c, compiled.c, count.c): call only when
    # reduction_supported() (AVX2).
    "reduction_supported": (_I32, []),
    "configure": (None, [_P, _P, _P, _P, _LL, _I32]),
    "tile_stats": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P,
                          _I64]),
    "row_lse": (None, [_P, _P, _I64, _I64, _P, _P, _P]),
    "best_lanes": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _P,
                          _I64, _P, _I64, _P, _P, _P]),
    "reduce_rows": (_I64, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64,
                           _P, _P, _P, _P, _P, _P, _I64]),
    "reduce_flagged": (_I64, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64,
                              _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _P]),
    "reduce_prepared": (_I64, [_P, _I64]),
    "use_emulated_exp": (_I32, [_P, _LL, _I32]),
    "emulated_exp_on": (_I32, []),
    "exp_lanes": (None, [_P, _I64]),
    "exp_mismatches": (_I64, [_U32, ctypes.c_uint64, _P]),
    "count_above": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64]),
    # kernels/noise/noise.c (philox.c, gumbel.c, sparse.c)
    "philox_vector_level": (_I32, [_I32]),
    "philox_bits": (None, [_P, _I64, _U32, _U32, _U32, _P]),
    "philox_bits_lanes": (None, [_P, _P, _P, _P, _I64, _P]),
    "gumbel_bounds": (None, [_P, _I64, _F32, _F32, _P]),
    "gumbel_candidates": (None, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _P, _F32, _F32,
                                 _F64, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _I64]),
    "scaled_rows": (None, [_P, _I64, _I64, _I64, _P, _P, _I64, _I64]),
    "cutoff_counts": (None, [_P, _I64, _P, _I64, _I64, _P, _P, _I64]),
    "cutoff_lanes": (None, [_P, _I64, _P, _I64, _I64, _P, _P, _P, _P, _I64]),
    "sparse_best": (None, [_P, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _P, _LL, _P, _P, _P, _P,
                           _I64]),
    "score_candidates": (None, [_P, _I64, _I64, _P, _P, _P, _I64, _P, _LL, _P, _P, _P, _P,
                                _I64]),
    # kernels/greedy/argmax.c
    "greedy_vector_level": (_I32, [_I32]),
    "greedy_argmax": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _P]),
    # kernels/radix/radix.c
    "radix_start": (None, [_P, _I64, _I64, _I64, _P, _F64, _P, _LL, _P, _P, _P, _P, _P, _I64]),
    "radix_round": (None, [_P, _P, _P, _I64, _I64, _I32, _I32, _P, _I32, _I32, _P, _I64]),
    "radix_below": (None, [_P, _I64, _I64, _I64, _P, _P, _I64]),
    "radix_fill_below": (None, [_P, _I64, _I64, _I64, _P, _I64]),
    "radix_top_values": (None, [_P, _I64, _I64, _I64, _I64, _P, _I64]),
    "radix_min_p": (None, [_P, _I64, _I64, _I64, _P, _P, _P, _LL, _P, _P, _I64]),
    # ranks/step/gate.c
    "gate_rows": (_I32, [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _I64,
                         _I64]),
    "write_payload": (_I32, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64]),
    "step_reduce": (_I32, [_P, _I64, _I64, _I64, _I64]),
}


def extension_path() -> str | None:
    """Where the built extension is (an editable install finds it in the checkout), or None
    when the package was built without it."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        return None
    return None if spec is None else spec.origin


_HANDLE: dict[str, object] = {}
_LOCK = threading.Lock()
_FAILURE: list[str] = []
"""Why a present extension did not load (one entry), for absence()."""


def library() -> ctypes.CDLL | None:
    """The extension with every signature declared, loaded once; None with HELIOS_NATIVE=0 or
    where it is absent or cannot load (every native path then reports unavailable)."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    return built_once(_HANDLE, _LOCK, _load)


def _load() -> ctypes.CDLL | None:
    path = extension_path()
    if path is None:
        return None
    import torch  # noqa: F401 - first, so that libgomp.so.1 resolves to torch's (see above)

    try:
        lib = ctypes.CDLL(path)
        declare(lib)
    except (OSError, AttributeError) as exc:
        _FAILURE.append(f"{type(exc).__name__}: {exc}")
        _LOG.warning("native kernels at %s unavailable (%s); using the torch paths", path, exc)
        return None
    return lib


def declare(lib: ctypes.CDLL) -> None:
    """Sets every exported function's restype and argtypes from SIGNATURES."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


def absence() -> str | None:
    """None when the native kernels are in use; else one line saying why not and that the
    torch paths serve (launch/serve.py prints it once at start-up)."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"native CPU kernels off ({SWITCH}=0); the torch paths run (same bits, slower)"
    if library() is not None:
        return None
    if extension_path() is None:
        return ("native CPU kernels absent (helios-logprobs was built without a C compiler); "
                "the torch paths run (same bits, slower)")
    failure = _FAILURE[0] if _FAILURE else "unknown error"
    return f"native CPU kernels failed to load ({failure}); the torch paths run (same bits)"


def built_once(state: dict, lock: threading.Lock,
               build: Callable[[], ctypes.CDLL | None]) -> ctypes.CDLL | None:
    """state["lib"], made by `build` on first use (None included: a failed check is not
    retried). Tests replace state["lib"] to force a path."""
    if "lib" not in state:
        with lock:
            if "lib" not in state:
                state["lib"] = build()
    return state["lib"]


def torch_openmp() -> bool:
    """Whether torch's own libgomp.so.1 is mapped in this process."""
    return bool(openmp_runtimes()) and all("/torch/lib/" in p for p in openmp_runtimes())


def openmp_runtimes() -> list[str]:
    """The files of every libgomp mapped in this process (one, torch's, where the extension
    shares it)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if "libgomp" in line.split()[-1]})


PARALLEL_LANES = 1 << 18
"""Calls over at least this many lanes split their rows across torch's intra-op threads; a
smaller call costs less than waking the threads (an OpenMP region is ~10-20 us here)."""


def parallel_threads(lanes: int) -> int:
    """Threads for a compiled call over `lanes` lanes: torch's intra-op threads, or 1."""
    import torch  # (as in mkl_routine)

    return torch.get_num_threads() if lanes >= PARALLEL_LANES else 1


def release_openmp_workers() -> bool:
    """Lets the calling thread's OpenMP workers go (libgomp's omp_pause_resource_all, soft);
    True when libgomp took the pause, False where torch does not use libgomp.

    libgomp keeps a pool of workers for every thread that has started a parallel region, and
    once it manages more threads than there are CPUs, its workers stop spinning between
    regions: every region then wakes them through the kernel. A process that loads a model
    on one thread and runs it on another has two pools; on 2 cores the stepping thread's small
    regions ran ~3x slower (a 16 x 256 x 768 matmul: 68 -> 240 us). The thread that did the
    loading calls this once it is done; it gets a new pool if it runs a parallel region again.
    """
    if not torch_openmp():
        return False
    try:
        return ctypes.CDLL(openmp_runtimes()[0]).omp_pause_resource_all(1) == 0  # (1: soft)
    except (OSError, AttributeError):
        return False


VML_MODE = 0x2 | 0x140000 | 0x100
"""VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode torch's vml.h passes to MKL's vector
math (vmsExp, vmdExp, ...), so a routine called with it returns torch's values."""


def mkl_routine(name: str) -> int | None:
    """Address of an MKL routine inside this torch build (None without MKL)."""
    import torch  # (only the libraries that call MKL need it)

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(getattr(ctypes.CDLL(path), name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
