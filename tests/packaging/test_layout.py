"""The install layout: pyproject.toml's package list and mapping against the tree.

The five folders install as subpackages of one namespace, `helios_logprobs`; a package missing
from the list would be left out of a wheel while an editable install still found it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("runtime", "ranks", "collectives", "kernels", "launch")
NAMESPACE = "helios_logprobs"


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return [Path(line) for line in out.splitlines()]


def test_every_folder_with_modules_or_data_is_a_listed_package():
    files = _tracked(*FOLDERS)
    folders = {f.parent for f in files if "__pycache__" not in f.parts}
    expected = {f"{NAMESPACE}." + ".".join(d.parts) for d in folders | set(map(Path, FOLDERS))}
    assert set(_setuptools()["packages"]) == expected


def test_the_five_folders_map_under_one_namespace_without_init_files():
    assert _setuptools()["package-dir"] == {f"{NAMESPACE}.{f}": f for f in FOLDERS}
    # No __init__.py at the top: a checkout on sys.path (pytest, `python -m` from the root)
    # must never shadow an installed package of the same name (Hugging Face's `kernels`).
    assert not [f for f in FOLDERS if (ROOT / f / "__init__.py").exists()]


def test_hugging_face_kernels_and_transformers_import_from_the_checkout_root():
    """The suite's own environment holds Hugging Face's `kernels` (the test extra): from the
    repository root, `kernels` is theirs and transformers imports."""
    code = ("import kernels, transformers.activations, helios_logprobs.kernels.api as api;"
            "print(kernels.__file__); print(api.__file__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    theirs, ours = done.stdout.split()
    assert "site-packages" in theirs and not theirs.startswith(str(ROOT / "kernels"))
    assert Path(ours) == ROOT / "kernels" / "api.py"
