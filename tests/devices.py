"""Where the tests run. The suite is a CPU suite, and stays one on a host with GPUs.

- Processes the tests start (gloo ranks, torchrun jobs, servers) get ``rank_env``: GPUs
  hidden (``CUDA_VISIBLE_DEVICES=""``) and ``TRITON_INTERPRET=1``. launch/ then picks gloo and
  the CPU, as in CI, instead of NCCL and ``cuda.set_device(LOCAL_RANK)`` (which a TP4 job
  cannot do on a one-GPU host). Opt-in: ``HELIOS_TEST_RANK_DEVICE=cuda`` gives every rank a GPU
  (NCCL), and a job with more ranks than the host has GPUs is skipped, not failed.
- In the pytest process itself, Triton decides once, when a kernel is defined, whether it
  compiles or interprets (``TRITON_INTERPRET``). tests/conftest.py sets ``TRITON_INTERPRET=1``
  when there is no CUDA; with CUDA it leaves the variable as the caller set it:
  - unset (scripts/device-check.sh): kernels compile for the GPU; the Triton tests move
    their tensors there (``TRITON_DEVICE``), tests/gpu runs, and tests marked
    ``triton_cpu`` (Triton kernels on CPU tensors, which need the interpreter) are skipped;
  - ``TRITON_INTERPRET=1``: everything stays on the CPU as in CI; tests/gpu is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

RANK_DEVICE = os.environ.get("HELIOS_TEST_RANK_DEVICE", "cpu")
"""Where rank processes started by the tests run: "cpu" (default, gloo) or "cuda" (NCCL)."""
if RANK_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"HELIOS_TEST_RANK_DEVICE: expected cpu or cuda, got {RANK_DEVICE!r}")

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def interpreting_triton() -> bool:
    """Whether @triton.jit kernels in this process run through the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_device() -> torch.device:
    """Where this process's Triton tests put their tensors."""
    if torch.cuda.is_available() and not interpreting_triton():
        return torch.device("cuda")
    return torch.device("cpu")


def missing_gpus(ranks: int) -> str | None:
    """Why a job of `ranks` rank processes cannot run here, or None when it can."""
    if RANK_DEVICE != "cuda":
        return None
    count = torch.cuda.device_count()
    if count < ranks:
        return f"needs {ranks} GPUs (one per rank), this host has {count}"
    return None


def rank_env(ranks: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the processes of a `ranks`-rank job (see the module docstring).
    Call ``missing_gpus(ranks)`` first: this raises when the job cannot run here."""
    env = dict(os.environ if base is None else base)
    if RANK_DEVICE == "cuda":
        reason = missing_gpus(ranks)
        if reason is not None:
            raise RuntimeError(reason)
        env.pop("TRITON_INTERPRET", None)
        if env.get("CUDA_VISIBLE_DEVICES") == "":
            del env["CUDA_VISIBLE_DEVICES"]
        return env
    env.update(CPU_ONLY)
    return env


def skip_without_gpus(ranks: int) -> None:
    """pytest.skip when a `ranks`-rank job cannot run on this host (see missing_gpus)."""
    import pytest

    reason = missing_gpus(ranks)
    if reason is not None:
        pytest.skip(reason)


def gpu_marks(compiled_triton: bool = True) -> list:
    """A tests/gpu module's ``pytestmark``: marked ``gpu`` and skipped without CUDA, and with
    ``compiled_triton`` also skipped while Triton interprets (TRITON_INTERPRET=1)."""
    marks = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    if compiled_triton:
        marks.append(pytest.mark.skipif(
            triton_device().type != "cuda",
            reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled"))
    return marks
