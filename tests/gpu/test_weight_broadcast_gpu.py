"""A trainer's weight broadcast into a model on a CUDA GPU (ranks/model/weight_transfer.py):
with NCCL (the default for CUDA ranks: the trainer on one GPU, the rank on another) and with
gloo named explicitly (host tensors, committed into the GPU's weights), the model then
computes the same logits, bit for bit, as one loaded from the new checkpoint on that GPU; a
tensor the trainer did not send fails the staging and the old weights stay. Skipped
without CUDA; the NCCL case needs two GPUs (NCCL refuses two members on one device). The
same path on the CPU with gloo: tests/server/rl/test_weight_updates.py (TP1, TP2)."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helios_logprobs.collectives import weight_transfer
from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.weight_transfer import (
    JoinWeightTransfer,
    ReceiveWeights,
    join_transfer,
    receive_update,
)
from tests.devices import gpu_marks
from tests.gpu.checkpoint import write_qwen2

pytestmark = gpu_marks(compiled_triton=False)
PROMPT = [5, 6, 7, 8, 5, 6, 7, 200, 13]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def logits(model) -> torch.Tensor:
    model.allocate_cache(1, 64)
    device = model.device

    def on(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    n = len(PROMPT)
    return model(on(PROMPT), on(list(range(n))), on([0] * n), torch.arange(n, device=device))


def broadcast_update(model, tensors: dict, backend: str, trainer_device: str) -> str | None:
    """The trainer (a thread of this process) opens the group and broadcasts ``tensors``;
    the model's rank joins, receives them and commits them if its shard is complete."""
    port, names = free_port(), sorted(tensors)
    opened: dict = {}

    def trainer() -> None:
        group = weight_transfer.trainer_init("127.0.0.1", port, 2, timeout_s=60,
                                             backend=backend, device=trainer_device)
        opened["group"] = group
        weight_transfer.trainer_send_weights(group, ((n, tensors[n]) for n in names))

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        error = join_transfer(model, JoinWeightTransfer("127.0.0.1", port, 1, 2, backend))
        assert error is None, error
        assert model.weight_transfer.device.type == ("cuda" if backend == "nccl" else "cpu")
        return receive_update(model, ReceiveWeights(
            tuple(names), ("float32",) * len(names),
            tuple(tuple(tensors[n].shape) for n in names), 1))
    finally:
        thread.join(60)
        weight_transfer.leave(opened.get("group"))
        weight_transfer.leave(getattr(model, "weight_transfer", None))


def reweighted(source: Path, target: Path) -> Path:
    """A copy of ``source`` whose every tensor is redrawn around its own scale (safetensors
    alone: tests/server/rl/checkpoints.py's, without the server package)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    for name, tensor in sorted(tensors.items()):
        noise = torch.randn(tensor.shape, generator=generator)
        tensors[name] = (tensor.float() + 0.5 * tensor.float().std() * noise).to(tensor.dtype)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("broadcast")
    a = write_qwen2(root / "a")
    return a, reweighted(a, root / "b")


def check_update(checkpoints, device: str, backend: str, trainer_device: str) -> None:
    a, b = checkpoints
    served = ShardedCausalLM.load(a, device=device, dtype=torch.float32)
    before, want = logits(served), logits(ShardedCausalLM.load(b, device=device,
                                                               dtype=torch.float32))
    assert not torch.equal(before, want)
    new = load_file(str(b / "model.safetensors"))
    partial = {name: t for name, t in new.items() if name != "model.norm.weight"}
    bad = broadcast_update(served, partial, backend, trainer_device)
    assert bad is not None and "model.norm.weight" in bad, bad
    assert torch.equal(logits(served), before)  # refused: the old weights serve
    assert broadcast_update(served, new, backend, trainer_device) is None
    assert torch.equal(logits(served), want)  # bit for bit


def test_gloo_broadcast_into_a_gpu_model(checkpoints):
    assert weight_transfer.backend_for("cuda:0") == "nccl"  # (gloo only when named)
    check_update(checkpoints, "cuda:0", "gloo", "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per member")
def test_nccl_broadcast_between_gpus(checkpoints):
    check_update(checkpoints, "cuda:1", "nccl", "cuda:0")
