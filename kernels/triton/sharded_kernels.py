"""The ``@triton.jit`` kernels of the sharded Triton reduction: launches 2, 3, 5 and 6 as
kernels/triton/sharded.py numbers and launches them (launches 1 and 4 are
``tile_stats_kernel`` and ``tile_keys_kernel`` from kernels/triton/common.py). A zero
``requested`` flag makes every kernel return before it reads, sorts or writes.
"""

from __future__ import annotations

import triton.language as tl
from helios_logprobs.kernels.triton.common import (
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
    prepared_kernel,
    store_natural_pairs,
    words_to_key,
)


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
