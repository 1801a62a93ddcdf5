"""Triton logprob reduction, one rank holding the whole vocabulary row: four prepared launches.

1. ``tile_stats_kernel`` (kernels/triton/common.py), grid (rows, tiles): per vocabulary tile
   the FP32 maximum and exponential mass relative to it.
2. ``_row_lse_kernel``, grid (rows,): the tiles' statistics -> the row's normalization
   lse = M + log(S) (FP32).
3. ``tile_keys_kernel`` (kernels/triton/common.py), grid (rows, tiles): per tile the best 32
   int64 sort keys of the reported values float32(x) - lse.
4. ``_final_merge_kernel``, grid (rows,): the chosen pair, then either the best K keys of all
   tiles or the caller's selected IDs, into the packed int32 [rows, 258] payload.

A zero ``requested`` flag makes every launch return before it reads the vocabulary, sorts or
writes: that row of ``out`` stays untouched. Padded lanes (lane >= vocab_size) are never
loaded. ``PreparedReduction`` owns all workspaces, so a call allocates nothing; its
constructor runs every launch once on a gated-off row, so the kernels are compiled before the
first real call (and before CUDA-graph capture).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS, TILE_CANDIDATES
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.triton.common import (
    canonical_nan,
    combine_tile_stats,
    fill_pairs,
    is_finite,
    merge_candidate_rows,
    prepared_kernel,
    store_natural_pairs,
)
from helios_logprobs.kernels.triton.prepared import (
    DEFAULT_BLOCK_SIZE,
    FLAG_DTYPES,
    GPU_MERGE_BLOCK,
    INDEX_DTYPES,
    LOGIT_DTYPES,
    MAX_BLOCK_TILES,
    MAX_MERGE_BLOCK,
    PreparedWorkspaces,
    cached_prepared,
    check_k,
    check_logits,
    check_matrix,
    check_selection,
    check_vector,
    normalize_device,
    pick_block_size,
    pick_merge_block,
    pick_select,
    tile_warps,
)

__all__ = [
    "PreparedReduction",
    "prepared_reduction",
    "reduce_triton",
    # Host-side helpers that lived here before kernels/triton/prepared.py (still importable
    # from this module; tests read GPU_MERGE_BLOCK from it).
    "DEFAULT_BLOCK_SIZE",
    "FLAG_DTYPES",
    "GPU_MERGE_BLOCK",
    "INDEX_DTYPES",
    "LOGIT_DTYPES",
    "MAX_BLOCK_TILES",
    "MAX_MERGE_BLOCK",
    "cached_prepared",
    "check_logits",
    "check_matrix",
    "check_selection",
    "check_vector",
    "normalize_device",
    "pick_block_size",
    "pick_merge_block",
    "pick_select",
    "tile_warps",
]

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@prepared_kernel
def _row_lse_kernel(
    requested_ptr,
    tile_max_ptr,
    tile_mass_ptr,
    stats_row_stride,
    lse_ptr,
    n_tiles,
    BLOCK_TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # 1. Zero flag: nothing read, nothing written.
    if tl.load(requested_ptr + row) == 0:
        return
    m, s = combine_tile_stats(
        tile_max_ptr + row * stats_row_stride,
        tile_mass_ptr + row * stats_row_stride,
        n_tiles,
        BLOCK_TILES,
    )
    # 2. lse = M + log(S). No finite lane: M = -inf, S = 0 -> -inf. A NaN logit: M = NaN.
    #    A +inf logit: M = +inf and S = NaN. All three are non-finite, which the later
    #    launches turn into the canonical NaN for every reported value.
    tl.store(lse_ptr + row, m + tl.log(s))


@prepared_kernel
def _final_merge_kernel(
    logits_ptr,
    logits_row_stride,
    chosen_ptr,
    ids_ptr,
    ids_row_stride,
    counts_ptr,
    requested_ptr,
    lse_ptr,
    cand_ptr,
    cand_row_stride,
    n_cand,
    out_ptr,
    out_row_stride,
    k,
    vocab_size,
    MAX_IDS: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    SELECT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # 1. Zero flag: the payload row is left exactly as it was.
    if tl.load(requested_ptr + row) == 0:
        return
    lse = tl.load(lse_ptr + row)
    lse_ok = is_finite(lse)
    logits_row = logits_ptr + row * logits_row_stride
    out_row = out_ptr + row * out_row_stride
    # 2. Chosen pair: its raw logit minus the same lse. An id outside [0, vocab_size) is
    #    never loaded (it would be a padded lane or out of bounds) and reports NaN.
    c = tl.load(chosen_ptr + row).to(tl.int64)
    c_ok = (c >= 0) & (c < vocab_size)
    xc = tl.load(logits_row + c, mask=c_ok, other=0.0).to(tl.float32)
    vc = tl.where(lse_ok, tl.where(c_ok, xc - lse, canonical_nan()), canonical_nan())
    tl.store(out_row, c.to(tl.int32))
    tl.store(out_row + 1, vc.to(tl.int32, bitcast=True))
    count = tl.minimum(tl.load(counts_ptr + row), MAX_IDS)
    if count > 0:
        # 3. Selected IDs, in caller order: raw logit - lse, no natural alternatives. Ids
        #    outside the vocabulary are not loaded and report NaN (the API rejects them).
        j = tl.arange(0, MAX_IDS)
        sel = j < count
        tid = tl.load(ids_ptr + row * ids_row_stride + j, mask=sel, other=-1)
        tid64 = tid.to(tl.int64)
        t_ok = sel & (tid64 >= 0) & (tid64 < vocab_size)
        xt = tl.load(logits_row + tid64, mask=t_ok, other=0.0).to(tl.float32)
        vt = tl.where(t_ok, xt - lse, canonical_nan())
        vt = tl.where(lse_ok, vt, canonical_nan())
        tl.store(out_row + 2 + 2 * j, tid, mask=sel)
        tl.store(out_row + 3 + 2 * j, vt.to(tl.int32, bitcast=True), mask=sel)
        fill_pairs(out_row, 2 * count)
    elif k > 0:
        # 4. Natural alternatives: the best K of every tile's sorted best 32. The global
        #    top-K (K <= 20 < 32) is inside the union of the tiles' top-32 lists, so the
        #    merge is exact; keys are unique per id, so the order is total.
        best = merge_candidate_rows(cand_ptr + row * cand_row_stride, n_cand, MERGE_BLOCK, SELECT)
        store_natural_pairs(out_row, best, k)
    else:
        fill_pairs(out_row, 0)


# --------------------------------------------------------------------------------------------
# Prepared reduction
# --------------------------------------------------------------------------------------------


class PreparedReduction(PreparedWorkspaces):
    """The four launches for up to ``rows`` rows of ``width`` logits of ``dtype`` on
    ``device``, with their workspaces (tile stats, lse, candidate keys) allocated once.

    ``__call__`` allocates nothing; with ``warmup=True`` (default) the constructor compiles
    every kernel for int32 and int64 ``chosen`` and int32 flags, ids and counts, so calls
    compile nothing either (integer arguments are not value-specialized and the small
    buffers not alignment-specialized; logits keep the 16-byte alignment of torch
    allocations and of row views whose stride is a multiple of 8 lanes).
    """

    def __init__(
        self,
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        block_size: int | None = None,
        merge_block: int | None = None,
        select: int | None = None,
        warmup: bool = True,
    ) -> None:
        super().__init__(rows, width, dtype, device, block_size=block_size,
                         merge_block=merge_block, select=select,
                         size_error="rows and width must be >= 1")
        self.lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        if warmup:
            self._warmup()

    def _warmup_launch(self, logits, chosen, requested) -> None:
        out = torch.zeros(1, PAYLOAD_WORDS, dtype=torch.int32, device=self.device)
        self._launch(logits, chosen, self.no_ids[:1], self.no_counts[:1], requested, 1,
                     self.width, out)

    def __call__(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        ids: torch.Tensor | None,
        counts: torch.Tensor | None,
        requested: torch.Tensor,
        k: int,
        vocab_size: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        rows = self._check_logits(logits)
        if not 1 <= vocab_size <= self.width:
            raise ValueError(f"vocab_size: expected 1..{self.width}, got {vocab_size}")
        check_k(k)
        ids, counts = self._check_request(chosen, ids, counts, requested, rows)
        check_matrix("out", out, (rows, PAYLOAD_WORDS), torch.int32, self.device)
        if rows == 0:
            return out
        self._launch(logits, chosen, ids, counts, requested, k, vocab_size, out)
        return out

    def _launch(self, logits, chosen, ids, counts, requested, k, vocab_size, out) -> None:
        rows = logits.shape[0]
        n_tiles = triton.cdiv(vocab_size, self.block_size)
        # Launch 1: tile maxima and masses.
        self._tile_stats(logits, requested, vocab_size, n_tiles)
        # Launch 2: per-row normalization.
        _row_lse_kernel[(rows,)](
            requested, self.tile_max, self.tile_mass, self.tile_max.stride(0),
            self.lse, n_tiles,
            BLOCK_TILES=self.block_tiles, num_warps=4,
        )
        # Launch 3: per-tile best 32 keys (ids = lane, no offset).
        self._tile_keys(logits, requested, counts, self.lse, vocab_size, 0, k, n_tiles)
        # Launch 4: the packed payload.
        _final_merge_kernel[(rows,)](
            logits, logits.stride(0), chosen, ids, ids.stride(0), counts, requested,
            self.lse, self.cand, self.cand.stride(0), n_tiles * TILE_CANDIDATES,
            out, out.stride(0), k, vocab_size,
            MAX_IDS=MAX_TOKEN_IDS, MERGE_BLOCK=self.merge_block, SELECT=self.select,
            num_warps=4,
        )


_PREPARED: dict[tuple, list[PreparedReduction]] = {}


def prepared_reduction(
    rows: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> PreparedReduction:
    """The cached PreparedReduction for (width, dtype, device) with capacity >= rows.

    Call it once with the largest row count before capture. A larger row count later adds a
    new object (at least double the capacity); earlier ones stay alive, so workspaces that a
    captured CUDA graph refers to are never freed.
    """
    return PreparedReduction.cached(_PREPARED, rows, width, dtype, device)


def reduce_triton(
    logits: torch.Tensor, request: RowRequest, vocab_size: int, out: torch.Tensor
) -> torch.Tensor:
    """Packed logprob payload for ``logits`` [rows, width] (whole vocabulary on this rank):
    ``request`` per row (kernels.rows), vocab_size <= width (later lanes are padding),
    out int32 [rows, 258]. Returns ``out``.
    """
    prepared = PreparedReduction.cached_for(_PREPARED, logits)
    return prepared(logits, request.chosen, request.ids, request.counts, request.requested,
                    request.k, vocab_size, out)
