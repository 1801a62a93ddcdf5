"""kernels/native.py and the native extension it binds: built at install, found in the
installed package, every signature the C definition's, torch's libgomp, code that runs on
every x86-64 CPU, and the torch paths (same bits) where the extension is off or absent."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from helios_logprobs.kernels import native
from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.radix import native as radix

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
UNITS = ("kernels/cpu", "kernels/noise", "kernels/greedy", "kernels/radix", "ranks/step")

needs_extension = pytest.mark.skipif(native.library() is None,
                                     reason="the package was built without the extension")


@needs_extension
def test_the_extension_is_the_installed_packages_own() -> None:
    """find_spec locates it beside kernels/native.py (an editable install: in the checkout)."""
    origin = Path(native.extension_path())
    assert origin.parent == Path(native.__file__).parent
    assert origin.name.startswith("_native.") and origin.suffix == ".so"
    assert native.absence() is None


C_TYPES = {"int": "c_int", "int64_t": "c_int64", "uint32_t": "c_uint32", "uint64_t": "c_uint64",
           "float": "c_float", "double": "c_double", "long long": "c_longlong"}


def c_definitions(units: tuple[str, ...] = UNITS) -> dict[str, tuple[str | None, list[str]]]:
    """Every exported (non-static) function defined in the C sources, as (restype, argtypes)
    ctypes names read off its definition: pointers and function-pointer typedefs are
    c_void_p."""
    found: dict[str, tuple[str | None, list[str]]] = {}
    for unit in units:
        for path in sorted((ROOT / unit).glob("*.c")):
            text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
            pointers = set(re.findall(r"typedef[^;(]*\(\s*\*\s*(\w+)\s*\)", text))
            for ret, name, args in re.findall(
                    r"^(void|int|int64_t)\s+(\w+)\s*\(([^)]*)\)\s*\{", text, flags=re.M):
                params = []
                for arg in (a.strip() for a in args.split(",") if a.strip() != "void"):
                    kind = re.sub(r"\bconst\b", "", arg.rsplit(None, 1)[0] if "*" not in arg
                                  else "*").strip()
                    params.append("c_void_p" if kind == "*" or kind in pointers
                                  else C_TYPES[kind])
                found[name] = (None if ret == "void" else C_TYPES[ret], params)
    return found


def test_every_signature_is_its_c_definitions() -> None:
    """(ctypes' aliases compare as one type: c_int64 is c_long here, as int64_t is long.)"""
    wanted = {name: (None if restype is None else getattr(ctypes, restype),
                     [getattr(ctypes, t) for t in argtypes])
              for name, (restype, argtypes) in c_definitions().items()}
    assert native.SIGNATURES == wanted


@needs_extension
def test_the_extension_exports_exactly_the_declared_functions() -> None:
    if shutil.which("nm") is None:
        pytest.skip("no nm here to list the extension's symbols")
    out = subprocess.run(["nm", "-D", "--defined-only", native.extension_path()],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    exported = {line.split()[2] for line in out if line.split()[1:2] == ["T"]}
    assert exported == set(native.SIGNATURES) | {"PyInit__native"}


@needs_extension
def test_the_openmp_runtime_is_torchs_own() -> None:
    """Built with -fopenmp against the soname torch's libgomp carries: one libgomp is mapped
    in this process, torch's."""
    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not bundled.exists():
        pytest.skip("this torch build does not ship libgomp")
    needed = subprocess.run(["readelf", "-d", native.extension_path()], capture_output=True,
                            text=True).stdout if shutil.which("readelf") else "[libgomp.so.1]"
    assert "[libgomp.so.1]" in needed
    native.library()
    assert [os.path.realpath(p) for p in native.openmp_runtimes()] == [os.path.realpath(bundled)]


@needs_extension
def test_threaded_launches_give_the_torch_launches_bits() -> None:
    """Rows split over 2 threads of torch's OpenMP team and one thread: tile_stats' bits."""
    from helios_logprobs.kernels.cpu.tiles import TileStats, tile_stats

    lib = compiled._lib()
    if lib is None:
        pytest.skip("the compiled reduction cannot apply here")
    x = (torch.randn(6, 9000, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    rows = np.arange(6, dtype=np.int64)
    want = tile_stats(x, torch.from_numpy(rows), 9000, 4096)
    for threads in (1, 2):
        got, _ = compiled._run(lib, x, rows, 9000, 4096, 0, threads=threads)
        for name, a, b in zip(TileStats._fields, got, want, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (threads, name)


def test_a_failed_check_is_not_retried() -> None:
    calls = []

    def build() -> None:
        calls.append(1)

    state: dict = {}
    lock = threading.Lock()
    assert native.built_once(state, lock, build) is None
    assert native.built_once(state, lock, build) is None
    assert calls == [1]


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
                         text=True, timeout=120, check=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    openmp, released, before, after = out[0] == "True", out[1] == "True", int(out[2]), int(out[3])
    if not openmp:
        pytest.skip("this torch build does not use libgomp")
    assert released
    assert after == before - 1


VECTOR = re.compile(r"%[yz]mm|%k[0-7]|\tv(?!err|erw)[a-z]")


@needs_extension
def test_vector_code_sits_in_functions_chosen_at_run_time() -> None:
    """The extension runs on every x86-64 CPU: AVX (VEX/EVEX) instructions appear only in
    functions built for AVX2/AVX-512 by name (target attributes, target_clones' .avx2 clones)
    and in the reduction's unit (built for AVX2, called only after reduction_supported())."""
    if os.uname().machine != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("an x86-64 check, with objdump")
    path = native.extension_path()
    symbols = subprocess.run(["readelf", "-sW", path], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    in_reduction, unit = set(), None
    for line in symbols:
        fields = line.split()
        if len(fields) >= 8 and fields[3] == "FILE":
            unit = fields[7]
        elif len(fields) >= 8 and fields[3] == "FUNC" and fields[4] == "LOCAL":
            in_reduction |= {fields[7]} if unit == "reduction.c" else set()
    reduction_exports = set(c_definitions(("kernels/cpu",))) - {"reduction_supported"}
    allowed = re.compile(r".*(avx2|avx512).*")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True,
                          text=True, check=True).stdout
    offenders = []
    for block in code.split("\n\n"):
        head = re.match(r"[0-9a-f]+ <([^>]+)>:", block.strip())
        if head is None or not VECTOR.search(block):
            continue
        name = head.group(1)
        base = name.split(".")[0]
        if not (allowed.match(name) or name in in_reduction or base in in_reduction
                or base in reduction_exports):
            offenders.append(name)
    assert not offenders


def run_python(code: str, env: dict[str, str], python: list[str] | None = None) -> dict:
    done = subprocess.run([*(python or [sys.executable]), "-c", code], capture_output=True,
                          text=True, timeout=300, env=env, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


PATHS = """
import json, torch
from helios_logprobs.kernels import native
from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.radix import native as radix
from helios_logprobs.kernels.greedy import native as greedy
from helios_logprobs.kernels.noise import philox_native
from helios_logprobs.kernels.radix import native as radix
from helios_logprobs.ranks.step.gate_native import native_gate
paths = {"reduction": compiled.available(), "greedy": greedy.available(),
         "philox": philox_native.available(), "radix": radix.available(),
         "gate": native_gate() is not None}
"""

OUTPUTS = PATHS + """
import hashlib
from helios_logprobs.kernels.api import reduce_logprobs
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
g = torch.Generator().manual_seed(7)
x = torch.randn(6, 32000, generator=g) * 3
chosen = torch.randint(0, 32000, (6,), generator=g)
payload = reduce_logprobs(x.bfloat16(), chosen, k=5)
cases = [(1, 0.0, 0, 1.0, 0.0), (2, 1.0, 0, 1.0, 0.0), (3, 0.7, 50, 1.0, 0.0),
         (4, 1.0, 0, 0.9, 0.0), (5, 0.3, 0, 1.0, 0.1), (6, 1.5, 2000, 0.95, 0.0)]
rows = [RowSampling(seed=s, position=3, temperature=t, top_k=k, top_p=p, min_p=m)
        for s, t, k, p, m in cases]
tokens = ShardedSampler(None, 0, 32000, 32000, 32000, 6).sample(x, rows, [[1]] * 6, [[1]] * 6)
digest = hashlib.sha256(payload.numpy().tobytes() + tokens.numpy().tobytes()).hexdigest()
print(json.dumps({"paths": paths, "absence": native.absence(), "digest": digest}))
"""


@needs_extension
def test_no_compiler_runs_at_run_time(tmp_path) -> None:
    """With no compiler reachable (no PATH, CC=/bin/false) and an empty cache, every native
    path is on and nothing is written to the cache."""
    env = {**os.environ, "PATH": "", "CC": "/bin/false", "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("HELIOS_NATIVE", None)
    got = run_python(PATHS + "print(json.dumps(paths))", env)
    assert got == {"reduction": compiled.available(), "greedy": True, "philox": True,
                   "radix": radix.available(), "gate": True}
    assert not (tmp_path / "cache").exists()


def test_helios_native_0_forces_every_torch_path_with_the_same_bits() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HELIOS_NATIVE"}
    on = run_python(OUTPUTS, env)
    off = run_python(OUTPUTS, {**env, "HELIOS_NATIVE": "0"})
    assert not any(off["paths"].values())
    assert "HELIOS_NATIVE=0" in off["absence"]
    assert off["digest"] == on["digest"]
    if native.library() is not None:
        assert on["paths"]["greedy"] and on["paths"]["gate"] and on["absence"] is None


def test_an_absent_extension_leaves_every_path_off_and_says_so() -> None:
    """As a build without a compiler leaves it: no extension module to find."""
    code = PATHS.replace("from helios_logprobs.kernels import native\n",
                         "from helios_logprobs.kernels import native\n"
                         "native.EXTENSION = 'helios_logprobs.kernels._not_built'\n")
    got = run_python(code + "print(json.dumps([paths, native.absence()]))",
                     {k: v for k, v in os.environ.items() if k != "HELIOS_NATIVE"})
    assert not any(got[0].values())
    assert "absent" in got[1] and "built without a C compiler" in got[1]


@pytest.mark.slow
def test_a_build_without_a_compiler_installs_and_runs_the_torch_paths(tmp_path) -> None:
    """CC=/bin/false: the optional extension is left out, the wheel still builds (with every
    C source), installs into a scratch virtualenv and gives this checkout's bits."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("runtime", "ranks", "collectives", "kernels", "launch"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {k: v for k, v in os.environ.items() if k != "HELIOS_NATIVE"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(source)], env={**env, "CC": "/bin/false"}, check=True, timeout=600,
                   capture_output=True)
    wheel, = tmp_path.glob("*.whl")
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)],
                           capture_output=True, text=True, check=True).stdout
    assert ".so" not in names
    sources = [p.relative_to(ROOT) for unit in ("kernels", *UNITS)
               for p in (ROOT / unit).glob("*.[ch]")]
    assert len(sources) >= 13  # (the 9 sources, 3 build units and abi6.h)
    assert all(f"helios_logprobs/{p}" in names for p in sources)
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    site, = venv.glob("lib/python*/site-packages")
    deps = Path(torch.__file__).parents[1]  # (torch and the rest, without this checkout)
    (site / "deps.pth").write_text(f"{deps}\n")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    theirs = run_python(OUTPUTS, env, [str(venv / "bin" / "python")])
    ours = run_python(OUTPUTS, env)
    assert not any(theirs["paths"].values())
    assert "built without a C compiler" in theirs["absence"]
    assert theirs["digest"] == ours["digest"]
