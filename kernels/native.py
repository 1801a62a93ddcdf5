"""Compile a small C source once and load it with ctypes (the CPU fast paths' native parts).

``load_library(name, source, flags, switch)`` builds ``source`` with the system C compiler
(``$CC``, else ``cc``) into a per-user cache directory keyed by a hash of the source, the
flags and the compiler, and loads it. It returns None (callers keep their torch path) when
the environment variable ``switch`` is "0", off x86-64/aarch64, without a compiler, or when
the build fails; the failure is logged once. Concurrent builders write the same file
atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

_LOG = logging.getLogger(__name__)

X86 = ("x86_64", "amd64")
MACHINES = (*X86, "aarch64", "arm64")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "helios-kernels"


def load_library(name: str, source: str, flags: tuple[str, ...], switch: str,
                 machines: tuple[str, ...] = MACHINES, quiet: bool = False
                 ) -> ctypes.CDLL | None:
    if os.environ.get(switch, "1") == "0":
        return None
    machine = platform.machine().lower()
    if machine not in machines:
        return None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None
    tag = hashlib.sha256((source + " ".join(flags) + cc).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{machine}_{tag}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                built = Path(tmp) / target.name
                subprocess.run([cc, *flags, "-o", str(built), str(src)], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders write the same file
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        if not quiet:  # (quiet: the caller has another build to try)
            _LOG.warning("native %s unavailable (%s); using the torch path", name, exc)
        return None


def torch_openmp() -> bool:
    """Whether torch's own libgomp.so.1 is mapped in this process: a library built with gcc's
    -fopenmp then shares it (the loader reuses a loaded soname), threads included."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any("/torch/lib/libgomp" in line for line in maps.splitlines())


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
        maps = Path("/proc/self/maps").read_text().splitlines()
        path = next(line.split()[-1] for line in maps if "/torch/lib/libgomp" in line)
        return ctypes.CDLL(path).omp_pause_resource_all(1) == 0  # (1: omp_pause_soft)
    except (OSError, StopIteration, AttributeError):
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


def built_once(state: dict, lock: threading.Lock,
               build: Callable[[], ctypes.CDLL | None]) -> ctypes.CDLL | None:
    """state["lib"], built by `build` on first use (None included: a failed build is not
    retried). Tests replace state["lib"] to force a path."""
    if "lib" not in state:
        with lock:
            if "lib" not in state:
                state["lib"] = build()
    return state["lib"]
