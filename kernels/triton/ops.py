"""The sharded Triton reduction's launches as ``torch.library.triton_op``s (issue 36).

Each op is one group of launches between two exchanges (kernels/triton/sharded.py), with
every buffer it reads or writes an argument, so a compiler sees the order the launches need
and the workspaces they use:

    helios::triton_shard_stats       launches 1-2: logits -> tile_max, tile_mass -> e1_out
    helios::triton_shard_candidates  launches 3-5: e1_all -> lse_out; logits, lse -> cand;
                                     cand, the request's ids and chosen -> e2_out
    helios::triton_final_merge       launch 6: e2_all, lse -> out

Why triton_op and wrap_triton rather than an opaque custom op: under torch.compile Inductor
traces into the body, sees each kernel with its grid and the tensors it mutates, and
schedules the launches in the compiled graph (no fallback into Python between them); eager
calls launch the same kernels through the same code. The mutated arguments are declared, so
functionalization orders tile_max/tile_mass before e1_out, lse before cand, cand before e2_out.

A fake implementation is registered for each op (they return nothing and only mutate their
arguments): tracing then never runs a kernel on fake tensors, which the Triton interpreter
(TRITON_INTERPRET=1, the CPU tests) cannot do. The grid and constexprs are the prepared
object's (kernels/triton/prepared.py), passed as ints, so an op call allocates nothing.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

import triton
from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, TILE_CANDIDATES
from helios_logprobs.kernels.triton.common import tile_keys_kernel, tile_stats_kernel
from helios_logprobs.kernels.triton.prepared import tile_warps
from helios_logprobs.kernels.triton.sharded_kernels import (
    _global_lse_kernel,
    _shard_merge_kernel,
    _shard_stats_kernel,
    _sharded_final_kernel,
)

FINAL_MERGE_BLOCK = 256
"""Gathered candidate keys (world * 32) the final launch loads per step: TP <= 8 in one."""


@triton_op("helios::triton_shard_stats", mutates_args={"tile_max", "tile_mass", "e1_out"})
def triton_shard_stats(logits: torch.Tensor, requested: torch.Tensor, local_valid: int,
                       block_size: int, block_tiles: int, tile_max: torch.Tensor,
                       tile_mass: torch.Tensor, e1_out: torch.Tensor) -> None:
    rows = logits.shape[0]
    n_tiles = triton.cdiv(local_valid, block_size)
    if n_tiles > 0:
        wrap_triton(tile_stats_kernel)[(rows, n_tiles)](
            logits, logits.stride(0), requested, tile_max, tile_mass, tile_max.stride(0),
            local_valid, BLOCK_SIZE=block_size, num_warps=tile_warps(block_size))
    wrap_triton(_shard_stats_kernel)[(rows,)](
        requested, tile_max, tile_mass, tile_max.stride(0), e1_out, e1_out.stride(0), n_tiles,
        BLOCK_TILES=block_tiles, num_warps=4)


@triton_shard_stats.register_fake
def _(logits, requested, local_valid, block_size, block_tiles, tile_max, tile_mass, e1_out):
    return None


@triton_op("helios::triton_shard_candidates", mutates_args={"cand", "lse_out", "e2_out"})
def triton_shard_candidates(logits: torch.Tensor, chosen: torch.Tensor, ids: torch.Tensor,
                            counts: torch.Tensor, requested: torch.Tensor,
                            e1_all: torch.Tensor, vocab_start: int, local_valid: int,
                            block_size: int, merge_block: int, select: int,
                            cand: torch.Tensor, lse_out: torch.Tensor,
                            e2_out: torch.Tensor) -> None:
    rows = logits.shape[0]
    n_tiles = triton.cdiv(local_valid, block_size)
    wrap_triton(_global_lse_kernel)[(rows,)](
        e1_all, e1_all.stride(0), e1_all.stride(1), requested, lse_out, e1_all.shape[0],
        num_warps=1)
    if n_tiles > 0:  # (the shard keeps 32 keys a tile: k is only known to the final merge)
        wrap_triton(tile_keys_kernel)[(rows, n_tiles)](
            logits, logits.stride(0), requested, counts, lse_out, cand, cand.stride(0),
            local_valid, vocab_start, TILE_CANDIDATES, BLOCK_SIZE=block_size, SELECT=select,
            num_warps=tile_warps(block_size))
    wrap_triton(_shard_merge_kernel)[(rows,)](
        logits, logits.stride(0), chosen, ids, ids.stride(0), counts, requested,
        cand, cand.stride(0), n_tiles * TILE_CANDIDATES, e2_out, e2_out.stride(0),
        vocab_start, local_valid, MAX_IDS=MAX_TOKEN_IDS, MERGE_BLOCK=merge_block,
        SELECT=select, num_warps=4)


@triton_shard_candidates.register_fake
def _(logits, chosen, ids, counts, requested, e1_all, vocab_start, local_valid, block_size,
      merge_block, select, cand, lse_out, e2_out):
    return None


@triton_op("helios::triton_final_merge", mutates_args={"out"})
def triton_final_merge(e2_all: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor,
                       ids: torch.Tensor, counts: torch.Tensor, requested: torch.Tensor,
                       starts: torch.Tensor, k: int, select: int, out: torch.Tensor) -> None:
    wrap_triton(_sharded_final_kernel)[(lse.shape[0],)](
        e2_all, e2_all.stride(0), e2_all.stride(1), e2_all.shape[0], lse, chosen, ids,
        ids.stride(0), counts, requested, starts, out, out.stride(0), k,
        MAX_IDS=MAX_TOKEN_IDS, MERGE_BLOCK=FINAL_MERGE_BLOCK, SELECT=select, num_warps=4)


@triton_final_merge.register_fake
def _(e2_all, lse, chosen, ids, counts, requested, starts, k, select, out):
    return None
