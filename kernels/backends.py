"""The reduction backends, what each needs of the device, and the sharded step interface."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from helios_logprobs.kernels.rows import RowRequest

if TYPE_CHECKING:
    from helios_logprobs.kernels.cpu.compiled import RepeatedCall

BACKENDS = ("reference", "torch", "triton")
SHARDED_BACKENDS = ("torch", "triton")


def require_triton_device(device: torch.device | str) -> None:
    """Triton kernels need a GPU, or the interpreter for CPU tensors (tests, debugging)."""
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
            "imported; use backend='torch' for the CPU production path"
        )


class ShardSteps(Protocol):
    """The three shard steps of the six-launch reduction (kernels/sharded.py drives them)."""

    def shard_stats(
        self, logits: torch.Tensor, request: RowRequest, local_valid: int, e1_out: torch.Tensor
    ) -> object:
        """Launches 1-2: the shard's (max, exp mass) per row -> exchange 1 words."""

    def shard_candidates(
        self,
        logits: torch.Tensor,
        request: RowRequest,
        e1_all: torch.Tensor,
        vocab_start: int,
        local_valid: int,
        lse_out: torch.Tensor,
        e2_out: torch.Tensor,
    ) -> object:
        """Launches 3-5: global lse, the shard's candidates and owned raw logits -> exchange 2."""

    def final_merge(
        self,
        e2_all: torch.Tensor,
        lse: torch.Tensor,
        request: RowRequest,
        shard_starts: Sequence[int],
        out: torch.Tensor,
    ) -> object:
        """Launch 6: every shard's words -> the packed payload, identical on every rank."""


def shard_steps(backend: str) -> ShardSteps:
    """The module implementing the shard steps for ``backend`` (triton imported on demand)."""
    if backend == "torch":
        from helios_logprobs.kernels.cpu import sharded as torch_sharded

        return torch_sharded
    if backend == "triton":
        from helios_logprobs.kernels.triton import sharded

        return sharded
    raise ValueError(f"sharded backend: expected one of {SHARDED_BACKENDS}, got {backend!r}")


def whole_reduction(backend: str, repeated: bool = False) -> Callable[..., torch.Tensor] | None:
    """What a one-rank group runs instead of the shard steps: ``reduce_torch`` for the torch
    backend (``reduce_torch_repeated`` for a caller that passes the same buffers on every
    call); None for Triton, whose prepared six launches also serve one rank."""
    if backend != "torch":
        return None
    from helios_logprobs.kernels.cpu.backend import reduce_torch, reduce_torch_repeated

    return reduce_torch_repeated if repeated else reduce_torch


def whole_native_call(
    backend: str, logits: torch.Tensor, request: RowRequest, vocab_size: int, out: torch.Tensor
) -> RepeatedCall | None:
    """The compiled C call that a one-rank repeated reduction of ``backend`` makes over these
    buffers, for a C caller that runs it itself; None for Triton, or where the compiled
    launches do not apply (no library, CUDA tensors)."""
    if backend != "torch":
        return None
    from helios_logprobs.kernels.cpu.backend import repeated_native_call

    return repeated_native_call(logits, request, vocab_size, out)
