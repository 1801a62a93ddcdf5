"""kernels/native.py: C sources built once into the cache and loaded, or None (with a
warning) whenever they cannot be, so that callers keep their torch paths."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.native import built_once, load_library, torch_openmp

SOURCE = "int answer(void) { return 42; }\n"
FLAGS = ("-O1", "-fPIC", "-shared")

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path / "helios-kernels"


@needs_cc
def test_a_source_is_built_once_and_loaded_from_the_cache(cache) -> None:
    lib = load_library("probe", SOURCE, FLAGS, "HELIOS_TEST_SWITCH")
    assert lib is not None and lib.answer() == 42
    built = list(cache.iterdir())
    assert len(built) == 1 and built[0].name.startswith("probe_")
    stamp = built[0].stat().st_mtime_ns
    again = load_library("probe", SOURCE, FLAGS, "HELIOS_TEST_SWITCH")
    assert again is not None and again.answer() == 42
    assert [p.stat().st_mtime_ns for p in cache.iterdir()] == [stamp]


def test_the_switch_turns_a_library_off(cache, monkeypatch) -> None:
    monkeypatch.setenv("HELIOS_TEST_SWITCH", "0")
    assert load_library("probe", SOURCE, FLAGS, "HELIOS_TEST_SWITCH") is None
    assert not cache.exists()


def test_a_failing_compiler_gives_none_and_a_warning(cache, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.kernels.native"):
        assert load_library("probe", SOURCE + "/* other */", FLAGS, "HELIOS_TEST_SWITCH") is None
    assert "native probe unavailable" in caplog.text


def test_a_missing_compiler_gives_none(cache, monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert load_library("probe", SOURCE, FLAGS, "HELIOS_TEST_SWITCH") is None


def test_a_failed_build_is_not_retried() -> None:
    calls = []
    state: dict = {}

    def build() -> ctypes.CDLL | None:
        calls.append(1)
        return None

    lock = threading.Lock()
    assert built_once(state, lock, build) is None
    assert built_once(state, lock, build) is None
    assert calls == [1]


def test_the_reduction_switch_keeps_the_torch_path(monkeypatch) -> None:
    """HELIOS_NATIVE_REDUCTION=0: the compiled launches stay off and every entry point says
    so (callers then run the numpy/torch path)."""
    monkeypatch.setenv("HELIOS_NATIVE_REDUCTION", "0")
    monkeypatch.setattr(compiled, "_STATE", {})
    assert not compiled.available()
    x = torch.randn(2, 300)
    assert compiled.compiled_tile_stats(x, np.arange(2), 300, 4096) is None


@pytest.mark.parametrize("openmp", [True, False])
def test_both_thread_fan_outs_give_the_torch_launches(monkeypatch, openmp) -> None:
    """The reduction library built with -fopenmp (rows on torch's OpenMP team) and without
    it (pthreads) both split rows over threads with the torch launches' bits."""
    from helios_logprobs.kernels.cpu.tiles import TileStats, tile_stats

    if openmp and not torch_openmp():
        pytest.skip("torch's libgomp is not loaded here")
    monkeypatch.setattr(compiled, "torch_openmp", lambda: openmp)
    monkeypatch.setattr(compiled, "_STATE", {})
    lib = compiled._lib()
    if lib is None:
        pytest.skip("the compiled reduction cannot apply here")
    x = (torch.randn(6, 9000, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    rows = np.arange(6, dtype=np.int64)
    got, _ = compiled._run(lib, x, rows, 9000, 4096, 0, threads=2)
    want = tile_stats(x, torch.from_numpy(rows), 9000, 4096)
    for name, a, b in zip(TileStats._fields, got, want, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name


RELEASE_SCRIPT = """
import os, time, torch
from helios_logprobs.kernels.native import release_openmp_workers, torch_openmp
torch.set_num_threads(2)
torch.exp(torch.randn(1 << 22))  # a parallel region: libgomp starts this thread's worker
before = len(os.listdir("/proc/self/task"))
released = release_openmp_workers()
time.sleep(0.5)
print(torch_openmp(), released, before, len(os.listdir("/proc/self/task")))
torch.exp(torch.randn(1 << 22))  # and a later region still runs
"""


def test_releasing_the_openmp_workers_ends_the_threads_libgomp_started() -> None:
    """Engine.start calls it on the thread that loaded the model; its worker threads exit."""
    out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True,
                         text=True, timeout=120, check=True, cwd=Path(__file__).parents[3],
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    openmp, released, before, after = out[0] == "True", out[1] == "True", int(out[2]), int(out[3])
    if not openmp:
        pytest.skip("this torch build does not use libgomp")
    assert released
    assert after == before - 1
