"""Triton logprob reduction, one rank holding the whole vocabulary row: four prepared launches.

1. ``tile_stats_kernel`` (kernels/triton_common.py), grid (rows, tiles): per vocabulary tile
   the FP32 maximum and exponential mass relative to it.
2. ``_row_lse_kernel``, grid (rows,): the tiles' statistics -> the row's normalization
   lse = M + log(S) (FP32).
3. ``tile_keys_kernel`` (kernels/triton_common.py), grid (rows, tiles): per tile the best 32
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

from kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS, TILE_CANDIDATES
from kernels.triton_common import (
    RANK_MAX_BLOCK,
    SELECT_RANK,
    SELECTS,
    canonical_nan,
    combine_tile_stats,
    default_select,
    fill_pairs,
    is_finite,
    merge_candidate_rows,
    next_power_of_2,
    prepared_kernel,
    store_natural_pairs,
    tile_keys_kernel,
    tile_stats_kernel,
)

DEFAULT_BLOCK_SIZE = 4096
"""Vocabulary lanes per tile (a power of two >= 32). 151,936 lanes -> 38 tiles per row."""
MAX_MERGE_BLOCK = 1024
"""Candidate keys the final merge loads per step (rows with more candidates loop); also the
largest block SELECT_RANK accepts."""
GPU_MERGE_BLOCK = 256
MAX_BLOCK_TILES = 1024
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
FLAG_DTYPES = (torch.int32, torch.int64, torch.bool)
"""int32 is the contract's flag dtype (warmed up); the others compile on first use."""


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
# Launcher checks (shared with kernels/triton_sharded.py)
# --------------------------------------------------------------------------------------------


def check_logits(logits: torch.Tensor, device: torch.device | None = None) -> None:
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(
            f"logits: expected fp32/bf16/fp16 [rows, width], got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: last dimension must be contiguous, strides {logits.stride()}")
    if logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]:
        raise ValueError(f"logits: row stride {logits.stride(0)} < width {logits.shape[1]}")
    if device is not None and logits.device != device:
        raise ValueError(f"logits: expected device {device}, got {logits.device}")


def check_vector(
    name: str, t: torch.Tensor, rows: int, dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    if t.shape != (rows,) or t.dtype not in dtypes:
        raise ValueError(
            f"{name}: expected {' or '.join(str(d) for d in dtypes)} ({rows},), "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    if rows > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous vector, stride {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_matrix(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Row-major matrix/tensor: exact shape and dtype, last dim contiguous, rows may be
    strided (a prefix view of a larger buffer is fine)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_selection(
    ids: torch.Tensor, counts: torch.Tensor, rows: int, device: torch.device
) -> None:
    check_matrix("ids", ids, (rows, MAX_TOKEN_IDS), torch.int32, device)
    check_vector("counts", counts, rows, (torch.int32,), device)


def normalize_device(device: torch.device | str) -> torch.device:
    """'cuda' -> 'cuda:<current>', so that it compares equal to a tensor's device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def pick_block_size(width: int, block_size: int | None, select: int) -> int:
    if block_size is None:
        cap = RANK_MAX_BLOCK if select == SELECT_RANK else DEFAULT_BLOCK_SIZE
        block_size = min(cap, max(next_power_of_2(width), TILE_CANDIDATES))
    if block_size < TILE_CANDIDATES or block_size & (block_size - 1):
        raise ValueError(
            f"block_size: expected a power of two >= {TILE_CANDIDATES}, got {block_size}"
        )
    if select == SELECT_RANK and block_size > RANK_MAX_BLOCK:
        raise ValueError(f"block_size: SELECT_RANK supports at most {RANK_MAX_BLOCK}")
    return block_size


def pick_merge_block(n_cand: int, merge_block: int | None, select: int) -> int:
    if merge_block is None:
        # The interpreter pays per operation, so fewer, larger chunks; on a GPU 256-key
        # chunks keep the bitonic network small (the merge runs once per row).
        cap = MAX_MERGE_BLOCK if select == SELECT_RANK else GPU_MERGE_BLOCK
        merge_block = min(next_power_of_2(n_cand), cap)
    merge_block = max(merge_block, TILE_CANDIDATES)
    if merge_block & (merge_block - 1) or merge_block > MAX_MERGE_BLOCK:
        raise ValueError(
            f"merge_block: expected a power of two in [32, {MAX_MERGE_BLOCK}], got {merge_block}"
        )
    return merge_block


def pick_select(select: int | None) -> int:
    select = default_select() if select is None else int(select)
    if select not in SELECTS:
        raise ValueError(f"select: expected one of {SELECTS}, got {select}")
    return select


def tile_warps(block_size: int) -> int:
    return 8 if block_size >= 4096 else 4


# --------------------------------------------------------------------------------------------
# Prepared reduction
# --------------------------------------------------------------------------------------------


class PreparedReduction:
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
        if rows < 1 or width < 1:
            raise ValueError(f"PreparedReduction: rows and width must be >= 1, got {rows}, {width}")
        if dtype not in LOGIT_DTYPES:
            raise ValueError(f"PreparedReduction: unsupported logits dtype {dtype}")
        self.rows = rows
        self.width = width
        self.dtype = dtype
        self.device = normalize_device(device)
        self.select = pick_select(select)
        self.block_size = pick_block_size(width, block_size, self.select)
        self.max_tiles = triton.cdiv(width, self.block_size)
        self.block_tiles = min(next_power_of_2(self.max_tiles), MAX_BLOCK_TILES)
        n_cand = self.max_tiles * TILE_CANDIDATES
        self.merge_block = pick_merge_block(n_cand, merge_block, self.select)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.tile_max = torch.empty(rows, self.max_tiles, **f32)
        self.tile_mass = torch.empty(rows, self.max_tiles, **f32)
        self.lse = torch.empty(rows, **f32)
        self.cand = torch.empty(rows, n_cand, dtype=torch.int64, device=self.device)
        # Used when the caller passes ids/counts as None (natural alternatives only).
        self.no_ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=self.device)
        self.no_counts = torch.zeros(rows, dtype=torch.int32, device=self.device)
        if warmup:
            self._warmup()

    def _warmup(self) -> None:
        dev = self.device
        logits = torch.zeros(1, self.width, dtype=self.dtype, device=dev)
        requested = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(1, PAYLOAD_WORDS, dtype=torch.int32, device=dev)
        for chosen_dtype in INDEX_DTYPES:
            chosen = torch.zeros(1, dtype=chosen_dtype, device=dev)
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
        check_logits(logits, self.device)
        rows, width = logits.shape
        if logits.dtype != self.dtype or width != self.width:
            raise ValueError(
                f"logits: prepared for {self.dtype} width {self.width}, "
                f"got {logits.dtype} width {width}"
            )
        if rows > self.rows:
            raise ValueError(f"logits: {rows} rows exceed the prepared capacity {self.rows}")
        if not 1 <= vocab_size <= width:
            raise ValueError(f"vocab_size: expected 1..{width}, got {vocab_size}")
        if not 0 <= k <= TILE_CANDIDATES:
            raise ValueError(f"k: expected 0..{TILE_CANDIDATES}, got {k}")
        if (ids is None) != (counts is None):
            raise ValueError("ids and counts: pass both or neither")
        if ids is None:
            ids, counts = self.no_ids[:rows], self.no_counts[:rows]
        check_selection(ids, counts, rows, self.device)
        check_vector("chosen", chosen, rows, INDEX_DTYPES, self.device)
        check_vector("requested", requested, rows, FLAG_DTYPES, self.device)
        check_matrix("out", out, (rows, PAYLOAD_WORDS), torch.int32, self.device)
        if rows == 0:
            return out
        self._launch(logits, chosen, ids, counts, requested, k, vocab_size, out)
        return out

    def _launch(self, logits, chosen, ids, counts, requested, k, vocab_size, out) -> None:
        rows = logits.shape[0]
        bs = self.block_size
        n_tiles = triton.cdiv(vocab_size, bs)
        warps = tile_warps(bs)
        # Launch 1: tile maxima and masses.
        tile_stats_kernel[(rows, n_tiles)](
            logits, logits.stride(0), requested,
            self.tile_max, self.tile_mass, self.tile_max.stride(0),
            vocab_size,
            BLOCK_SIZE=bs, num_warps=warps,
        )
        # Launch 2: per-row normalization.
        _row_lse_kernel[(rows,)](
            requested, self.tile_max, self.tile_mass, self.tile_max.stride(0),
            self.lse, n_tiles,
            BLOCK_TILES=self.block_tiles, num_warps=4,
        )
        # Launch 3: per-tile best 32 keys (ids = lane, no offset).
        tile_keys_kernel[(rows, n_tiles)](
            logits, logits.stride(0), requested, counts, self.lse,
            self.cand, self.cand.stride(0),
            vocab_size, 0, k,
            BLOCK_SIZE=bs, SELECT=self.select, num_warps=warps,
        )
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
    device = normalize_device(device)
    return cached_prepared(_PREPARED, (device, dtype, width), rows,
                   lambda capacity: PreparedReduction(capacity, width, dtype, device))


def cached_prepared(cache: dict, key: tuple, rows: int, build):
    """The smallest cached object for key with capacity >= rows, else a new one."""
    entries = cache.setdefault(key, [])
    for prepared in entries:  # ascending capacity
        if prepared.rows >= rows:
            return prepared
    capacity = max(rows, 2 * entries[-1].rows) if entries else rows
    prepared = build(capacity)
    entries.append(prepared)
    return prepared


def reduce_triton(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    ids: torch.Tensor | None,
    counts: torch.Tensor | None,
    requested: torch.Tensor,
    k: int,
    vocab_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Packed logprob payload for ``logits`` [rows, width] (whole vocabulary on this rank).

    chosen int32/int64 [rows]; ids int32 [rows, 128] and counts int32 [rows] (or both None:
    natural alternatives only); requested int32 [rows] (0 = leave the row untouched);
    0 <= k <= 32 natural alternatives; vocab_size <= width (later lanes are padding);
    out int32 [rows, 258]. Returns ``out``.
    """
    check_logits(logits)
    prepared = prepared_reduction(max(logits.shape[0], 1), logits.shape[1], logits.dtype,
                                  logits.device)
    return prepared(logits, chosen, ids, counts, requested, k, vocab_size, out)
