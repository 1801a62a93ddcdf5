"""Triton logprob reduction over vocabulary shards: six prepared launches per rank.

Each rank holds ``logits`` [rows, width] for its shard: global ids vocab_start + lane for
lane < local_valid; later lanes are padding and never read. The backend-agnostic driver
(kernels/sharded.py) calls, per step:

    shard_stats        launches 1-2   -> e1_out [rows, 2]      all-gather -> e1_all
    shard_candidates   launches 3-5   -> e2_out [rows, 129]    all-gather -> e2_all
    final_merge        launch 6       -> out [rows, 258] (identical on every rank)

1. ``tile_stats_kernel`` (triton_common), grid (rows, tiles): tile FP32 max and exp mass.
2. ``_shard_stats_kernel``, grid (rows,): the shard's (max, mass) as FP32 bits -> e1_out.
3. ``_global_lse_kernel``, grid (rows,): every shard's (max, mass) combined in rank order ->
   lse. All ranks run the same kernel on the same gathered words, so lse is bit-identical.
4. ``tile_keys_kernel`` (triton_common), grid (rows, tiles): per tile the best 32 sort keys
   of float32(x) - lse with GLOBAL ids.
5. ``_shard_merge_kernel``, grid (rows,): the shard's best 32 keys, or the raw logits of the
   selected IDs it owns, and the chosen token's raw logit if it owns it -> e2_out.
6. ``_sharded_final_kernel``, grid (rows,): the owners' words and every shard's keys -> the
   packed payload, the same on every rank.

A zero ``requested`` flag makes every launch return before reading the vocabulary, sorting
or writing: that row of e1_out, e2_out, lse_out and out stays untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.layout import (
    EXCHANGE1_WORDS,
    EXCHANGE2_WORDS,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
    TILE_CANDIDATES,
)
from kernels.triton_backend import (
    FLAG_DTYPES,
    INDEX_DTYPES,
    LOGIT_DTYPES,
    MAX_BLOCK_TILES,
    cached_prepared,
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
from kernels.triton_common import (
    EMPTY_KEY,
    NCAND,
    canonical_nan,
    combine_tile_stats,
    fill_pairs,
    is_finite,
    key_high_word,
    key_low_word,
    merge_candidate_rows,
    merge_top32,
    next_power_of_2,
    prepared_kernel,
    store_natural_pairs,
    tile_keys_kernel,
    tile_stats_kernel,
    words_to_key,
)

FINAL_MERGE_BLOCK = 256
"""Gathered candidate keys (world * 32) the final launch loads per step: TP <= 8 in one."""


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@prepared_kernel
def _shard_stats_kernel(
    requested_ptr,
    tile_max_ptr,
    tile_mass_ptr,
    stats_row_stride,
    e1_ptr,
    e1_row_stride,
    n_tiles,
    BLOCK_TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    # 1. No valid lane (local_valid == 0 -> n_tiles == 0): the loops run zero times and the
    #    shard reports (-inf, 0), which the global combination skips.
    m, s = combine_tile_stats(
        tile_max_ptr + row * stats_row_stride,
        tile_mass_ptr + row * stats_row_stride,
        n_tiles,
        BLOCK_TILES,
    )
    # 2. Exchange 1 row layout (kernels.layout.EXCHANGE1_WORDS = 2):
    #      word 0 = shard max M_r as FP32 bits (NaN if the shard saw a NaN logit)
    #      word 1 = shard exp mass S_r = sum exp(x - M_r) as FP32 bits
    e1_row = e1_ptr + row * e1_row_stride
    tl.store(e1_row, m.to(tl.int32, bitcast=True))
    tl.store(e1_row + 1, s.to(tl.int32, bitcast=True))


@prepared_kernel
def _global_lse_kernel(
    e1_ptr,
    e1_world_stride,
    e1_row_stride,
    requested_ptr,
    lse_ptr,
    world,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    e1_row = e1_ptr + row * e1_row_stride
    # 1. Global max, rank 0 first. NaN is counted, never fed to tl.maximum.
    m_all = tl.full([], float("-inf"), tl.float32)
    nan_count = tl.zeros([], tl.int32)
    for r in range(world):
        m_r = tl.load(e1_row + r * e1_world_stride).to(tl.float32, bitcast=True)
        nan_count += (m_r != m_r).to(tl.int32)
        m_all = tl.maximum(m_all, tl.where(m_r != m_r, float("-inf"), m_r))
    # 2. Mass rescaled to the global max, summed sequentially in rank order: the same FP32
    #    operations in the same order on every rank, hence a bit-identical lse. A shard at
    #    -inf (no finite lane) contributes exactly 0.
    s_all = tl.zeros([], tl.float32)
    for r in range(world):
        m_r = tl.load(e1_row + r * e1_world_stride).to(tl.float32, bitcast=True)
        s_r = tl.load(e1_row + r * e1_world_stride + 1).to(tl.float32, bitcast=True)
        s_all += tl.where(m_r > float("-inf"), s_r * tl.exp(m_r - m_all), 0.0)
    # 3. Non-finite results (all -inf, +inf, NaN) make every reported value NaN later.
    lse = m_all + tl.log(s_all)
    lse = tl.where(nan_count > 0, canonical_nan(), lse)
    tl.store(lse_ptr + row, lse)


@prepared_kernel
def _shard_merge_kernel(
    logits_ptr,
    logits_row_stride,
    chosen_ptr,
    ids_ptr,
    ids_row_stride,
    counts_ptr,
    requested_ptr,
    cand_ptr,
    cand_row_stride,
    n_cand,
    e2_ptr,
    e2_row_stride,
    vocab_start,
    local_valid,
    MAX_IDS: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    SELECT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    logits_row = logits_ptr + row * logits_row_stride
    e2_row = e2_ptr + row * e2_row_stride
    # Exchange 2 row layout (kernels.layout.EXCHANGE2_WORDS = 129):
    #   word 0        chosen token's raw logit FP32 bits if this shard owns it, else 0
    #   natural (count == 0):
    #     words 1..64   the shard's best 32 keys, best first, as (high int32, low int32)
    #                   halves (kernels.sortkeys.keys_to_words; no candidate = EMPTY_KEY)
    #     words 65..128 0
    #   selected (count > 0):
    #     word 1 + j    raw logit FP32 bits of ids[j] if this shard owns it, else 0
    #                   (j < count; only the owner's word is read), later words 0
    # 1. Ownership: vocab_start <= id < vocab_start + local_valid; nothing else is loaded,
    #    so padded lanes and other shards' ids never read this shard's logits.
    c = tl.load(chosen_ptr + row).to(tl.int64) - vocab_start
    c_own = (c >= 0) & (c < local_valid)
    xc = tl.load(logits_row + c, mask=c_own, other=0.0).to(tl.float32)
    tl.store(e2_row, tl.where(c_own, xc.to(tl.int32, bitcast=True), 0))
    count = tl.minimum(tl.load(counts_ptr + row), MAX_IDS)
    j = tl.arange(0, MAX_IDS)
    if count > 0:
        sel = j < count
        local = tl.load(ids_ptr + row * ids_row_stride + j, mask=sel, other=-1).to(tl.int64)
        local = local - vocab_start
        own = sel & (local >= 0) & (local < local_valid)
        x = tl.load(logits_row + local, mask=own, other=0.0).to(tl.float32)
        tl.store(e2_row + 1 + j, tl.where(own, x.to(tl.int32, bitcast=True), 0))
    else:
        # 2. Best 32 of this shard's tiles' 32 each: exact for any K <= 32 since every
        #    member of the shard's top-32 is in its own tile's top-32.
        best = merge_candidate_rows(cand_ptr + row * cand_row_stride, n_cand, MERGE_BLOCK, SELECT)
        slots = tl.arange(0, NCAND)
        tl.store(e2_row + 1 + 2 * slots, key_high_word(best))
        tl.store(e2_row + 2 + 2 * slots, key_low_word(best))
        zeros = tl.zeros([MAX_IDS], tl.int32)
        tl.store(e2_row + 1 + 2 * NCAND + j, zeros, mask=j < MAX_IDS - 2 * NCAND)


@prepared_kernel
def _sharded_final_kernel(
    e2_ptr,
    e2_world_stride,
    e2_row_stride,
    world,
    lse_ptr,
    chosen_ptr,
    ids_ptr,
    ids_row_stride,
    counts_ptr,
    requested_ptr,
    starts_ptr,
    out_ptr,
    out_row_stride,
    k,
    MAX_IDS: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    SELECT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(requested_ptr + row) == 0:
        return
    lse = tl.load(lse_ptr + row)
    lse_ok = is_finite(lse)
    e2_row = e2_ptr + row * e2_row_stride
    out_row = out_ptr + row * out_row_stride
    # 1. Owner of a global id = the number of shard starts starts[1..world-1] at or below
    #    it: a sequential scan, any world size. An empty shard has the same start as the
    #    next one, so both are counted and the id goes to the later, non-empty shard.
    vocab = tl.load(starts_ptr + world)
    # 2. Chosen pair: the owner's word 0 minus the shared lse; an id outside [0, vocab)
    #    has no owner and reports NaN.
    c = tl.load(chosen_ptr + row).to(tl.int64)
    c_ok = (c >= 0) & (c < vocab)
    c_owner = tl.zeros([], tl.int64)
    for r in range(1, world):
        c_owner += (tl.load(starts_ptr + r) <= c).to(tl.int64)
    xc = tl.load(e2_row + c_owner * e2_world_stride, mask=c_ok, other=0)
    vc = tl.where(c_ok, xc.to(tl.float32, bitcast=True) - lse, canonical_nan())
    vc = tl.where(lse_ok, vc, canonical_nan())
    tl.store(out_row, c.to(tl.int32))
    tl.store(out_row + 1, vc.to(tl.int32, bitcast=True))
    count = tl.minimum(tl.load(counts_ptr + row), MAX_IDS)
    if count > 0:
        # 3. Selected IDs in caller order: word 1 + j of the id's owner.
        j = tl.arange(0, MAX_IDS)
        sel = j < count
        tid = tl.load(ids_ptr + row * ids_row_stride + j, mask=sel, other=-1)
        tid64 = tid.to(tl.int64)
        t_ok = sel & (tid64 >= 0) & (tid64 < vocab)
        owner = tl.zeros([MAX_IDS], tl.int64)
        for r in range(1, world):
            owner += (tl.load(starts_ptr + r) <= tid64).to(tl.int64)
        xt = tl.load(e2_row + owner * e2_world_stride + 1 + j, mask=t_ok, other=0)
        vt = tl.where(t_ok, xt.to(tl.float32, bitcast=True) - lse, canonical_nan())
        vt = tl.where(lse_ok, vt, canonical_nan())
        tl.store(out_row + 2 + 2 * j, tid, mask=sel)
        tl.store(out_row + 3 + 2 * j, vt.to(tl.int32, bitcast=True), mask=sel)
        fill_pairs(out_row, 2 * count)
    elif k > 0:
        # 4. Natural: best K of world x 32 gathered keys. Each shard's list holds its best
        #    32 >= K, so the global best K are among them; keys carry global ids and the
        #    reported values (computed with this same lse), so nothing is re-read.
        n_cand = world * NCAND
        offs = tl.arange(0, MERGE_BLOCK)
        best = tl.full([NCAND], EMPTY_KEY, tl.int64)
        for start in range(0, n_cand, MERGE_BLOCK):
            cidx = start + offs
            ok = cidx < n_cand
            rank = (cidx // NCAND).to(tl.int64)
            slot = cidx % NCAND
            word = e2_row + rank * e2_world_stride + 1 + 2 * slot
            high = tl.load(word, mask=ok, other=0)
            low = tl.load(word + 1, mask=ok, other=0)
            keys = tl.where(ok, words_to_key(high, low), EMPTY_KEY)
            best = merge_top32(best, keys, SELECT)
        store_natural_pairs(out_row, best, k)
    else:
        fill_pairs(out_row, 0)


# --------------------------------------------------------------------------------------------
# Prepared launches
# --------------------------------------------------------------------------------------------


class PreparedShardedReduction:
    """The six launches for up to ``rows`` rows of a ``width``-lane shard of ``dtype`` on
    ``device``, owning the tile-statistics and candidate-key workspaces.

    Calls allocate nothing (except that a ``shard_starts`` given as a Python sequence is
    copied to the device once and cached); with ``warmup=True`` the constructor compiles all
    six kernels for int32 and int64 ``chosen`` before the first call.
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
            raise ValueError(f"PreparedShardedReduction: rows, width >= 1, got {rows}, {width}")
        if dtype not in LOGIT_DTYPES:
            raise ValueError(f"PreparedShardedReduction: unsupported logits dtype {dtype}")
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
        self.cand = torch.empty(rows, n_cand, dtype=torch.int64, device=self.device)
        self.no_ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=self.device)
        self.no_counts = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self._starts: dict[tuple[int, ...], torch.Tensor] = {}
        if warmup:
            self._warmup()

    def _warmup(self) -> None:
        dev = self.device
        logits = torch.zeros(1, self.width, dtype=self.dtype, device=dev)
        requested = torch.zeros(1, dtype=torch.int32, device=dev)
        e1 = torch.zeros(1, 1, EXCHANGE1_WORDS, dtype=torch.int32, device=dev)
        e2 = torch.zeros(1, 1, EXCHANGE2_WORDS, dtype=torch.int32, device=dev)
        lse = torch.zeros(1, dtype=torch.float32, device=dev)
        out = torch.zeros(1, PAYLOAD_WORDS, dtype=torch.int32, device=dev)
        starts = self.starts_tensor([0, self.width])
        ids, counts = self.no_ids[:1], self.no_counts[:1]
        for chosen_dtype in INDEX_DTYPES:
            chosen = torch.zeros(1, dtype=chosen_dtype, device=dev)
            self._stats(logits, requested, self.width, e1[0])
            self._candidates(logits, chosen, ids, counts, requested, e1, 0, self.width, lse, e2[0])
            _launch_final(e2, lse, chosen, ids, counts, requested, 1, starts, out, self.select)

    def starts_tensor(self, shard_starts: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if isinstance(shard_starts, torch.Tensor):
            return shard_starts
        key = tuple(int(s) for s in shard_starts)
        t = self._starts.get(key)
        if t is None:
            t = torch.tensor(key, dtype=torch.int64, device=self.device)
            self._starts[key] = t
        return t

    # ---------------------------------------------------------------- launches 1-2
    def stats(
        self,
        logits: torch.Tensor,
        requested: torch.Tensor,
        local_valid: int,
        e1_out: torch.Tensor,
    ) -> torch.Tensor:
        rows = self._check_logits(logits)
        if not 0 <= local_valid <= logits.shape[1]:
            raise ValueError(f"local_valid: expected 0..{logits.shape[1]}, got {local_valid}")
        check_vector("requested", requested, rows, FLAG_DTYPES, self.device)
        check_matrix("e1_out", e1_out, (rows, EXCHANGE1_WORDS), torch.int32, self.device)
        if rows:
            self._stats(logits, requested, local_valid, e1_out)
        return e1_out

    def _stats(self, logits, requested, local_valid, e1_out) -> None:
        rows = logits.shape[0]
        bs = self.block_size
        n_tiles = triton.cdiv(local_valid, bs)
        if n_tiles > 0:
            tile_stats_kernel[(rows, n_tiles)](
                logits, logits.stride(0), requested,
                self.tile_max, self.tile_mass, self.tile_max.stride(0),
                local_valid,
                BLOCK_SIZE=bs, num_warps=tile_warps(bs),
            )
        _shard_stats_kernel[(rows,)](
            requested, self.tile_max, self.tile_mass, self.tile_max.stride(0),
            e1_out, e1_out.stride(0), n_tiles,
            BLOCK_TILES=self.block_tiles, num_warps=4,
        )

    # ---------------------------------------------------------------- launches 3-5
    def candidates(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        ids: torch.Tensor | None,
        counts: torch.Tensor | None,
        requested: torch.Tensor,
        e1_all: torch.Tensor,
        vocab_start: int,
        local_valid: int,
        lse_out: torch.Tensor,
        e2_out: torch.Tensor,
    ) -> torch.Tensor:
        rows = self._check_logits(logits)
        if not 0 <= local_valid <= logits.shape[1]:
            raise ValueError(f"local_valid: expected 0..{logits.shape[1]}, got {local_valid}")
        if vocab_start < 0:
            raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
        if (ids is None) != (counts is None):
            raise ValueError("ids and counts: pass both or neither")
        if ids is None:
            ids, counts = self.no_ids[:rows], self.no_counts[:rows]
        check_selection(ids, counts, rows, self.device)
        check_vector("chosen", chosen, rows, INDEX_DTYPES, self.device)
        check_vector("requested", requested, rows, FLAG_DTYPES, self.device)
        if e1_all.dim() != 3 or e1_all.shape[0] < 1:
            raise ValueError(f"e1_all: expected [world, rows, 2], got {tuple(e1_all.shape)}")
        check_matrix("e1_all", e1_all, (e1_all.shape[0], rows, EXCHANGE1_WORDS), torch.int32,
                     self.device)
        check_vector("lse_out", lse_out, rows, (torch.float32,), self.device)
        check_matrix("e2_out", e2_out, (rows, EXCHANGE2_WORDS), torch.int32, self.device)
        if rows:
            self._candidates(logits, chosen, ids, counts, requested, e1_all, vocab_start,
                             local_valid, lse_out, e2_out)
        return e2_out

    def _candidates(self, logits, chosen, ids, counts, requested, e1_all, vocab_start,
                    local_valid, lse_out, e2_out) -> None:
        rows = logits.shape[0]
        bs = self.block_size
        n_tiles = triton.cdiv(local_valid, bs)
        # Launch 3: global lse from every rank's exchange-1 words, in rank order.
        _global_lse_kernel[(rows,)](
            e1_all, e1_all.stride(0), e1_all.stride(1), requested, lse_out, e1_all.shape[0],
            num_warps=1,
        )
        # Launch 4: per-tile best 32 keys with global ids vocab_start + lane. The shard
        # always keeps 32 (k is only known to the final merge), hence k=32 here.
        if n_tiles > 0:
            tile_keys_kernel[(rows, n_tiles)](
                logits, logits.stride(0), requested, counts, lse_out,
                self.cand, self.cand.stride(0),
                local_valid, vocab_start, TILE_CANDIDATES,
                BLOCK_SIZE=bs, SELECT=self.select, num_warps=tile_warps(bs),
            )
        # Launch 5: the shard's exchange-2 row (layout in _shard_merge_kernel).
        _shard_merge_kernel[(rows,)](
            logits, logits.stride(0), chosen, ids, ids.stride(0), counts, requested,
            self.cand, self.cand.stride(0), n_tiles * TILE_CANDIDATES,
            e2_out, e2_out.stride(0), vocab_start, local_valid,
            MAX_IDS=MAX_TOKEN_IDS, MERGE_BLOCK=self.merge_block, SELECT=self.select,
            num_warps=4,
        )

    # ---------------------------------------------------------------- launch 6
    def final(
        self,
        e2_all: torch.Tensor,
        lse: torch.Tensor,
        chosen: torch.Tensor,
        ids: torch.Tensor | None,
        counts: torch.Tensor | None,
        requested: torch.Tensor,
        k: int,
        shard_starts: torch.Tensor | Sequence[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        return _final_merge_checked(
            e2_all, lse, chosen, ids, counts, requested, k, self.starts_tensor(shard_starts),
            out, self.select, self.no_ids, self.no_counts,
        )

    def _check_logits(self, logits: torch.Tensor) -> int:
        check_logits(logits, self.device)
        rows, width = logits.shape
        if logits.dtype != self.dtype or width != self.width:
            raise ValueError(
                f"logits: prepared for {self.dtype} width {self.width}, "
                f"got {logits.dtype} width {width}"
            )
        if rows > self.rows:
            raise ValueError(f"logits: {rows} rows exceed the prepared capacity {self.rows}")
        return rows


def _final_merge_checked(e2_all, lse, chosen, ids, counts, requested, k, starts, out, select,
                         no_ids, no_counts) -> torch.Tensor:
    device = lse.device
    rows = lse.shape[0] if lse.dim() == 1 else -1
    if e2_all.dim() != 3 or e2_all.shape[0] < 1:
        raise ValueError(f"e2_all: expected [world, rows, 129], got {tuple(e2_all.shape)}")
    world = e2_all.shape[0]
    check_matrix("e2_all", e2_all, (world, rows, EXCHANGE2_WORDS), torch.int32, device)
    check_vector("lse", lse, rows, (torch.float32,), device)
    if (ids is None) != (counts is None):
        raise ValueError("ids and counts: pass both or neither")
    if ids is None:
        if no_ids.shape[0] < rows:
            raise ValueError(f"ids: required for {rows} rows (prepared for {no_ids.shape[0]})")
        ids, counts = no_ids[:rows], no_counts[:rows]
    check_selection(ids, counts, rows, device)
    check_vector("chosen", chosen, rows, INDEX_DTYPES, device)
    check_vector("requested", requested, rows, FLAG_DTYPES, device)
    check_vector("shard_starts", starts, world + 1, (torch.int64,), device)
    if not 0 <= k <= TILE_CANDIDATES:
        raise ValueError(f"k: expected 0..{TILE_CANDIDATES}, got {k}")
    check_matrix("out", out, (rows, PAYLOAD_WORDS), torch.int32, device)
    if rows:
        _launch_final(e2_all, lse, chosen, ids, counts, requested, k, starts, out, select)
    return out


def _launch_final(e2_all, lse, chosen, ids, counts, requested, k, starts, out, select) -> None:
    rows = lse.shape[0]
    _sharded_final_kernel[(rows,)](
        e2_all, e2_all.stride(0), e2_all.stride(1), e2_all.shape[0],
        lse, chosen, ids, ids.stride(0), counts, requested, starts,
        out, out.stride(0), k,
        MAX_IDS=MAX_TOKEN_IDS, MERGE_BLOCK=FINAL_MERGE_BLOCK,
        SELECT=select, num_warps=4,
    )


# --------------------------------------------------------------------------------------------
# The driver's entry points (kernels/sharded.py)
# --------------------------------------------------------------------------------------------

_PREPARED: dict[tuple, list[PreparedShardedReduction]] = {}


def prepared_sharded(
    rows: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> PreparedShardedReduction:
    """The cached PreparedShardedReduction for (width, dtype, device) with capacity >= rows
    (call once with the largest row count before capture; earlier objects stay alive)."""
    device = normalize_device(device)
    return cached_prepared(_PREPARED, (device, dtype, width), rows,
                   lambda capacity: PreparedShardedReduction(capacity, width, dtype, device))


def _any_prepared(rows: int, device: torch.device) -> PreparedShardedReduction | None:
    for (dev, _, _), entries in _PREPARED.items():
        for prepared in entries:
            if dev == device and prepared.rows >= rows:
                return prepared
    return None


def shard_stats(
    logits: torch.Tensor,
    requested: torch.Tensor,
    local_valid: int,
    e1_out: torch.Tensor,
) -> torch.Tensor:
    """Launches 1-2: e1_out int32 [rows, 2] = (shard max, shard exp mass) as FP32 bits."""
    check_logits(logits)
    prepared = prepared_sharded(max(logits.shape[0], 1), logits.shape[1], logits.dtype,
                                logits.device)
    return prepared.stats(logits, requested, local_valid, e1_out)


def shard_candidates(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    ids: torch.Tensor | None,
    counts: torch.Tensor | None,
    requested: torch.Tensor,
    e1_all: torch.Tensor,
    vocab_start: int,
    local_valid: int,
    lse_out: torch.Tensor,
    e2_out: torch.Tensor,
) -> torch.Tensor:
    """Launches 3-5: lse_out fp32 [rows] (bit-identical on every rank) and e2_out int32
    [rows, 129] (layout in _shard_merge_kernel) from e1_all int32 [world, rows, 2]."""
    check_logits(logits)
    prepared = prepared_sharded(max(logits.shape[0], 1), logits.shape[1], logits.dtype,
                                logits.device)
    return prepared.candidates(logits, chosen, ids, counts, requested, e1_all, vocab_start,
                               local_valid, lse_out, e2_out)


def final_merge(
    e2_all: torch.Tensor,
    lse: torch.Tensor,
    chosen: torch.Tensor,
    ids: torch.Tensor | None,
    counts: torch.Tensor | None,
    requested: torch.Tensor,
    k: int,
    shard_starts: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Launch 6: the packed payload out int32 [rows, 258], identical on every rank.

    shard_starts: world + 1 ints (last = vocab_size), an int64 device tensor or a sequence
    (copied to the device once per distinct value and cached)."""
    rows = lse.shape[0]
    prepared = _any_prepared(rows, lse.device)
    if prepared is None:
        prepared = prepared_sharded(max(rows, 1), TILE_CANDIDATES, torch.float32, lse.device)
    return prepared.final(e2_all, lse, chosen, ids, counts, requested, k, shard_starts, out)
