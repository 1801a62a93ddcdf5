"""Checkpoints for weight-update tests: a copy of a checkpoint with other weights (the same
names, shapes and tokenizer), optionally with a tensor renamed or narrowed."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def reweighted(source: Path, target: Path, seed: int, edit=None) -> Path:
    """A copy of ``source`` whose tensors are redrawn around their own scale from ``seed``
    (``edit(tensors)`` may then rename or reshape some)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(tensors.items()):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        tensors[name] = (tensor.float() + 0.5 * tensor.float().std() * noise).to(tensor.dtype)
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def rename_norm(tensors: dict) -> None:
    tensors["model.norm.weights"] = tensors.pop("model.norm.weight")


def narrow_down_proj(tensors: dict) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
