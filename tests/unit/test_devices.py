"""The suite stays on the CPU on a GPU host (tests/devices.py): rank processes see no GPU and
interpret Triton; with HELIOS_TEST_RANK_DEVICE=cuda, jobs wider than the host's GPU count are
skipped, never started."""

from __future__ import annotations

import pytest
import torch

from tests import devices


def test_rank_processes_hide_gpus_and_interpret_triton(monkeypatch):
    monkeypatch.setattr(devices, "RANK_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = devices.rank_env(4, {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin"})
    assert env == {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PATH": "/bin"}
    assert devices.missing_gpus(4) is None  # on the CPU any world size runs


def test_gpu_ranks_skip_when_the_host_has_too_few(monkeypatch):
    monkeypatch.setattr(devices, "RANK_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.missing_gpus(1) is None
    assert devices.missing_gpus(4) == "needs 4 GPUs (one per rank), this host has 1"
    base = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PATH": "/bin"}
    assert devices.rank_env(1, base) == {"PATH": "/bin"}
    with pytest.raises(RuntimeError, match="needs 2 GPUs"):
        devices.rank_env(2, base)
    with pytest.raises(pytest.skip.Exception, match="needs 4 GPUs"):
        devices.skip_without_gpus(4)


def test_triton_device_follows_the_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert devices.interpreting_triton() and devices.triton_device().type == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not devices.interpreting_triton() and devices.triton_device().type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.triton_device().type == "cpu"
