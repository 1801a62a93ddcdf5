"""The torch backend's reduction launches as custom ops (``torch.library``), so a compiled
step (``torch.compile(fullgraph=True)``) treats each launch as one opaque node.

Each op declares the tensors it writes (``mutates_args``): the compiler sees that the request
(chosen, ids, counts, requested) and the logits are read, that the launch's send words, its
lse and the packed rows are written, and so keeps the record -> request -> launch -> exchange
-> merge -> payload order. The fake implementations write nothing and return nothing: every
output is a caller-allocated tensor whose shape the caller fixed. The real implementations
are the CPU launches (kernels/cpu/backend.py, kernels/cpu/sharded.py), which read numpy views
of the same buffers; inside a compiled graph those buffers are ordinary local tensors.
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.cpu import sharded as torch_sharded
from helios_logprobs.kernels.cpu.backend import reduce_torch
from helios_logprobs.kernels.rows import RowRequest

_ROWS = ("chosen", "ids", "counts", "requested")


@torch.library.custom_op("helios::whole_reduction", mutates_args=("out",))
def whole_reduction(logits: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor,
                    counts: torch.Tensor, requested: torch.Tensor, k: int, vocab_size: int,
                    out: torch.Tensor) -> None:
    """One rank: the four whole-vocabulary launches -> packed rows of ``out``."""
    reduce_torch(logits, RowRequest(chosen, ids, counts, requested, k), vocab_size, out)


@whole_reduction.register_fake
def _(logits, chosen, ids, counts, requested, k, vocab_size, out) -> None:
    return None


@torch.library.custom_op("helios::shard_stats", mutates_args=("e1_out",))
def shard_stats(logits: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, requested: torch.Tensor, k: int, local_valid: int,
                e1_out: torch.Tensor) -> None:
    """Launches 1-2 -> exchange 1's send words."""
    request = RowRequest(chosen, ids, counts, requested, k)
    torch_sharded.shard_stats(logits, request, local_valid, e1_out)


@shard_stats.register_fake
def _(logits, chosen, ids, counts, requested, k, local_valid, e1_out) -> None:
    return None


@torch.library.custom_op("helios::shard_candidates", mutates_args=("lse_out", "e2_out"))
def shard_candidates(logits: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor,
                     counts: torch.Tensor, requested: torch.Tensor, k: int,
                     e1_all: torch.Tensor, vocab_start: int, local_valid: int,
                     lse_out: torch.Tensor, e2_out: torch.Tensor) -> None:
    """Launches 3-5: the global lse and exchange 2's send words."""
    request = RowRequest(chosen, ids, counts, requested, k)
    torch_sharded.shard_candidates(logits, request, e1_all, vocab_start, local_valid, lse_out,
                                   e2_out)


@shard_candidates.register_fake
def _(logits, chosen, ids, counts, requested, k, e1_all, vocab_start, local_valid, lse_out,
      e2_out) -> None:
    return None


@torch.library.custom_op("helios::final_merge", mutates_args=("out",))
def final_merge(e2_all: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor,
                ids: torch.Tensor, counts: torch.Tensor, requested: torch.Tensor, k: int,
                shard_starts: list[int], out: torch.Tensor) -> None:
    """Launch 6: every shard's words -> packed rows of ``out``."""
    request = RowRequest(chosen, ids, counts, requested, k)
    torch_sharded.final_merge(e2_all, lse, request, list(shard_starts), out)


@final_merge.register_fake
def _(e2_all, lse, chosen, ids, counts, requested, k, shard_starts, out) -> None:
    return None
