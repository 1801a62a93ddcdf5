"""A wheel built from the checkout works where the project's users live: installed
non-editable into a fresh virtual environment beside transformers and Hugging Face's `kernels`
(the import name this project's kernels/ folder once took), away from the checkout.

The fresh environment gets the wheel and nothing else; its other dependencies (torch, the
HTTP stack, transformers, Hugging Face's `kernels`) come from the suite's environment through
a .pth line, which adds that site-packages folder without running its .pth files, so the
suite's editable install of this project stays invisible there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import openai
import pytest

from tests.server.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "ranks", "collectives", "kernels", "launch")
pytestmark = pytest.mark.slow


def _sources() -> list[Path]:
    """The checkout's files as git sees them (tracked or new, not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [Path(line) for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def sources() -> list[Path]:
    return _sources()


@pytest.fixture(scope="module")
def wheel(sources, tmp_path_factory) -> Path:
    """`pip wheel . --no-deps` over a copy of the checkout's files (what a clone holds)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for rel in sources:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, timeout=600)
    (built,) = out.glob("helios_logprobs-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel, installed non-editable."""
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True,
                   timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print("
                              "sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    # The suite's site-packages for the dependencies, after the fresh one's own.
    Path(purelib, "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    return env


def test_the_wheel_holds_every_module_source_and_data_file(wheel, sources):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"helios_logprobs/" + rel.as_posix() for rel in sources
                if rel.parts[0] in FOLDERS and rel.suffix in (".py", ".c", ".h", ".txt")}
    assert expected - names == set()
    assert not [n for n in names if n.split("/")[0] in FOLDERS]  # nothing at the top level


def run_in(env: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / "python"), "-c", code], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})


def test_installed_beside_transformers_and_hugging_face_kernels(venv, tmp_path):
    done = run_in(venv, (
        "import kernels, transformers.activations, helios_logprobs.kernels.api as api\n"
        "import helios_logprobs.runtime.http.server\n"
        "print(kernels.__file__); print(api.__file__)\n"
        "for old in ('runtime', 'ranks', 'collectives', 'launch'):\n"
        "    try:\n"
        "        __import__(old)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'{old} imports')\n"
    ), tmp_path)
    assert done.returncode == 0, done.stderr
    theirs, ours = done.stdout.split()
    assert "/kernels/" in theirs and "helios_logprobs" not in theirs
    assert ours.startswith(str(venv)) and not ours.startswith(str(ROOT))


def test_the_installed_server_answers_a_completion_with_logprobs(venv, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "helios_logprobs.launch.serve", "--port", str(port),
         "--model", "tiny", "--capacity", "2", "--max-model-len", "128"],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                           "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the server exited before serving"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="The garden", max_tokens=4,
                                        logprobs=5, temperature=0)
        logprobs = out.choices[0].logprobs
        assert len(logprobs.tokens) == 4
        assert all(len(top) == 5 for top in logprobs.top_logprobs)
        assert all(v <= 0.0 for v in logprobs.token_logprobs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
