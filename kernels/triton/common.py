"""Shared ``@triton.jit`` helpers for the Triton logprob reductions.

Used by ``kernels/triton/backend.py`` (one rank holds the whole row, four launches) and
``kernels/triton/sharded.py`` (vocabulary shards, six launches). Everything here is a device
function or a launch-independent kernel; the launchers live in those two modules, their
shared geometry, workspaces and shape/dtype/stride checks in ``kernels/triton/prepared.py``.

Sort keys (DESIGN.md, kernels/sortkeys.py): a 64-bit integer, larger is better. High 32 bits
= order-preserving map of the reported FP32 value's bits (-0.0 normalized to +0.0), low 32
bits = 0xFFFFFFFF - token_id. Stored as int64 with the top bit flipped, so that *signed*
comparison (what ``tl.max``/``tl.topk`` do on int64) orders keys as the unsigned layout
would; the high half read as a signed int32 is then ``bits`` for non-negative floats and
``bits ^ 0x7FFFFFFF`` for negative ones. This file produces bit-identical keys to
``kernels.sortkeys.make_keys``.
"""

from __future__ import annotations

import inspect
import os

import triton
import triton.language as tl
from helios_logprobs.kernels.layout import PAYLOAD_WORDS, TILE_CANDIDATES
from helios_logprobs.kernels.sortkeys import EMPTY_KEY as _EMPTY_KEY_INT

EMPTY_KEY: tl.constexpr = tl.constexpr(_EMPTY_KEY_INT)
"""A slot holding no candidate; below every real key (see kernels/sortkeys.py)."""
MAX_KEY: tl.constexpr = tl.constexpr(2**63 - 1)
"""Above every real key: the largest real high half is 0x7FC00000 (the canonical NaN that a
non-finite normalization reports), never 0x7FFFFFFF, so the first strict ``< MAX_KEY``
extraction step cannot skip a real key."""
LOW_MASK: tl.constexpr = tl.constexpr(0xFFFFFFFF)
SIGN_FLIP: tl.constexpr = tl.constexpr(0x7FFFFFFF)
CANONICAL_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
NCAND: tl.constexpr = tl.constexpr(TILE_CANDIDATES)
PAIR_WORDS: tl.constexpr = tl.constexpr(PAYLOAD_WORDS - 2)

SELECT_EXTRACT = 0
"""Tile/merge top-32 by 32 rounds of ``tl.max`` over keys strictly below the previous pick
(keys are unique per token id, so this is an exact sorted top-32)."""
SELECT_TOPK = 1
"""Tile/merge top-32 by ``tl.topk`` (bitonic top-k). Slow under the interpreter."""
SELECT_RANK = 2
"""Tile/merge top-32 by ranking: rank[i] = #{j: key[j] > key[i]} from one [N, N] comparison,
then slot r takes the key of rank r. O(N^2) work but a handful of whole-block operations,
which is what the interpreter is fast at (its cost is per operation, not per element)."""
SELECTS = (SELECT_EXTRACT, SELECT_TOPK, SELECT_RANK)
RANK_MAX_BLOCK = 1024


ALIGNED_POINTERS = ("logits_ptr", "tile_max_ptr", "tile_mass_ptr", "cand_ptr")
"""Pointers that keep Triton's 16-byte alignment specialization (vectorized vocabulary loads;
the workspaces are whole allocations). Every other pointer (flags, ids, counts, chosen, lse,
exchange words, payload) may be a row-offset view of a larger buffer, e.g. one position of
the [2, capacity, T, 258] payload, so it is not specialized on alignment."""


def prepared_kernel(fn):
    """``triton.jit`` for a launch kernel that is compiled once, before the first call.

    Integer arguments (every parameter that is neither ``*_ptr`` nor constexpr) are not
    specialized on their value (== 1, % 16): strides, sizes, k and world vary per call. The
    small-buffer pointers are not specialized on alignment (ALIGNED_POINTERS), where this
    Triton version supports that option. So a call compiles nothing after warm-up.
    """
    params = inspect.signature(fn).parameters
    constexpr = ("tl.constexpr", tl.constexpr)
    ints = [
        n for n, p in params.items() if not n.endswith("_ptr") and p.annotation not in constexpr
    ]
    kwargs = {"do_not_specialize": ints}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kwargs["do_not_specialize_on_alignment"] = [
            n for n in params if n.endswith("_ptr") and n not in ALIGNED_POINTERS
        ]
    return triton.jit(**kwargs)(fn)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_select() -> int:
    """Selection network per platform: tl.topk compiles to shuffles on a GPU; under the
    interpreter each block operation costs ~0.5 ms whatever its size, so the few-operation
    ranking network is fastest there (tl.topk costs ~100x more)."""
    if interpreting():
        return SELECT_RANK
    return SELECT_TOPK if hasattr(tl, "topk") else SELECT_EXTRACT


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# --------------------------------------------------------------------------------------------
# Scalars and keys
# --------------------------------------------------------------------------------------------


@triton.jit
def canonical_nan():
    # 1. The one NaN this reduction reports: built from its bit pattern, so it is 0x7FC00000
    #    on every backend and matches torch.full(..., nan) in the reference bit for bit.
    return tl.full([], CANONICAL_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def is_finite(x):
    # 1. NaN fails every comparison, so |x| < inf is false for NaN and +-inf alike.
    return tl.abs(x) < float("inf")


@triton.jit
def sort_key(value, token_id):
    """FP32 reported values + int64 global token ids -> int64 sort keys (signed storage)."""
    # 1. -0.0 == 0.0 is true: normalize signed zero so both map to the same high half.
    v = tl.where(value == 0.0, 0.0, value)
    bits = v.to(tl.int32, bitcast=True)
    # 2. Order-preserving map in signed int32: non-negative floats keep their bits (already
    #    ordered), negative floats flip the magnitude bits so a larger magnitude sorts lower.
    high = tl.where(bits < 0, bits ^ SIGN_FLIP, bits)
    # 3. Low half 0xFFFFFFFF - id is in [0, 2**32): equal values rank the smaller id higher.
    low = tl.full([], LOW_MASK, tl.int64) - token_id.to(tl.int64)
    return (high.to(tl.int64) << 32) | low


@triton.jit
def key_value_bits(key):
    """Sort key -> int32 FP32 bits of the reported value (+0.0 for a normalized zero)."""
    high = (key >> 32).to(tl.int32)
    return tl.where(high < 0, high ^ SIGN_FLIP, high)


@triton.jit
def key_token_id(key):
    """Sort key -> int64 token id."""
    return tl.full([], LOW_MASK, tl.int64) - (key & LOW_MASK)


@triton.jit
def key_high_word(key):
    # 1. Arithmetic shift then truncation: the signed high int32 as kernels.sortkeys
    #    keys_to_words writes it.
    return (key >> 32).to(tl.int32)


@triton.jit
def key_low_word(key):
    # 1. Truncating int64 -> int32 keeps the low 32 bits (two's complement), i.e. the
    #    unsigned low half's bit pattern.
    return (key & LOW_MASK).to(tl.int32)


@triton.jit
def words_to_key(high, low):
    # 1. The low word is sign-extended by the cast; mask it back to its 32 bits.
    return (high.to(tl.int64) << 32) | (low.to(tl.int64) & LOW_MASK)


# --------------------------------------------------------------------------------------------
# Top-32 selection
# --------------------------------------------------------------------------------------------


@triton.jit
def top32(keys, SELECT: tl.constexpr):
    """Best 32 int64 keys of a block (numel >= 32, power of two), sorted descending."""
    if SELECT == 1:
        # 1. Bitonic top-k over the block; real keys are unique (one per token id), and
        #    EMPTY_KEY pads compare below all of them, so ties never need breaking here.
        best = tl.topk(keys, NCAND)
    elif SELECT == 2:
        # 3. Ranking: a real key's rank is its sorted position (keys are unique). All
        #    EMPTY_KEY pads share the rank n_real; slots with no key of their rank (only
        #    possible from n_real on) keep EMPTY_KEY. The [N, N] block caps N at 1024.
        tl.static_assert(keys.numel <= 1024, "SELECT_RANK needs a block of at most 1024")
        rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
        slots = tl.arange(0, NCAND)
        hit = rank[None, :] == slots[:, None]
        best = tl.max(tl.where(hit, keys[None, :], EMPTY_KEY), axis=1)
    else:
        # 2. 32 rounds: take the largest key strictly below the previous pick. Unique keys
        #    make this an exact sorted top-32; once real keys run out every pick is
        #    EMPTY_KEY (nothing is below it), which the consumers treat as "no candidate".
        slots = tl.arange(0, NCAND)
        best = tl.full([NCAND], EMPTY_KEY, tl.int64)
        prev = tl.full([], MAX_KEY, tl.int64)
        for i in range(NCAND):
            cur = tl.max(tl.where(keys < prev, keys, EMPTY_KEY), axis=0)
            best = tl.where(slots == i, cur, best)
            prev = cur
    return best


@triton.jit
def merge_top32(best, chunk, SELECT: tl.constexpr):
    """Merge a running sorted best-32 with a chunk of keys -> new best-32."""
    # 1. The chunk's own top-32 first (so the join below is always 64 wide), then the top-32
    #    of the union. A key occurs in at most one chunk, so no key is counted twice.
    chunk_best = top32(chunk, SELECT)
    both = tl.reshape(tl.join(best, chunk_best), [2 * NCAND])
    return top32(both, SELECT)


# --------------------------------------------------------------------------------------------
# Launch 1 (both backends): per (row, tile) FP32 maximum and exponential mass
# --------------------------------------------------------------------------------------------


@prepared_kernel
def tile_stats_kernel(
    logits_ptr,
    logits_row_stride,
    requested_ptr,
    tile_max_ptr,
    tile_mass_ptr,
    stats_row_stride,
    vocab_size,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    # 1. Zero flag: no vocabulary read, nothing written (the row's stats stay stale and are
    #    never read, since every later launch gates on the same flag).
    if tl.load(requested_ptr + row) == 0:
        return
    lanes = tile * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE).to(tl.int64)
    # 2. Padded lanes (lane >= vocab_size; may hold +inf/NaN garbage) are never loaded:
    #    they read as -inf and are excluded again below, so they enter neither the max nor
    #    the mass.
    valid = lanes < vocab_size
    x = tl.load(logits_ptr + row * logits_row_stride + lanes, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    # 3. NaN never reaches tl.max (its NaN semantics differ per platform): it is counted
    #    and the tile reports max = NaN, which makes the row's normalization non-finite.
    is_nan = (x != x) & valid
    has_nan = tl.sum(is_nan.to(tl.int32), axis=0) > 0
    xs = tl.where(is_nan, float("-inf"), x)
    m = tl.max(xs, axis=0)
    # 4. Mass relative to the tile max. Lanes at -inf (padded, masked NaN, real -inf)
    #    contribute exactly 0; a tile whose max is -inf has mass 0 (exp(-inf - -inf) would be
    #    NaN, so it is selected away, never summed). A +inf max yields a NaN mass, which is
    #    fine: the normalization is non-finite either way.
    e = tl.where(xs > float("-inf"), tl.exp(xs - m), 0.0)
    s = tl.sum(e, axis=0)
    m = tl.where(has_nan, canonical_nan(), m)
    tl.store(tile_max_ptr + row * stats_row_stride + tile, m)
    tl.store(tile_mass_ptr + row * stats_row_stride + tile, s)


@triton.jit
def combine_tile_stats(tile_max_ptr, tile_mass_ptr, n_tiles, BLOCK_TILES: tl.constexpr):
    """One row's tile (max, mass) pairs -> (row max, row mass relative to it)."""
    offs = tl.arange(0, BLOCK_TILES)
    # 1. Pass 1, the maximum. Tiles beyond n_tiles read as -inf. NaN is tracked separately
    #    so the result is NaN iff some tile saw a NaN, independent of tl.max's NaN rules.
    m_all = tl.full([], float("-inf"), tl.float32)
    nan_count = tl.zeros([], tl.int32)
    for start in range(0, n_tiles, BLOCK_TILES):
        t = start + offs
        mt = tl.load(tile_max_ptr + t, mask=t < n_tiles, other=float("-inf"))
        nan_count += tl.sum((mt != mt).to(tl.int32), axis=0)
        m_all = tl.maximum(m_all, tl.max(tl.where(mt != mt, float("-inf"), mt), axis=0))
    # 2. Pass 2, the mass rescaled to the row max. A tile at -inf contributes 0 (it has no
    #    finite lane); with no finite lane at all the mass is 0 and log(0) = -inf below.
    s_all = tl.zeros([], tl.float32)
    for start in range(0, n_tiles, BLOCK_TILES):
        t = start + offs
        ok = t < n_tiles
        mt = tl.load(tile_max_ptr + t, mask=ok, other=float("-inf"))
        st = tl.load(tile_mass_ptr + t, mask=ok, other=0.0)
        live = ok & (mt > float("-inf"))
        s_all += tl.sum(tl.where(live, st * tl.exp(mt - m_all), 0.0), axis=0)
    m_all = tl.where(nan_count > 0, canonical_nan(), m_all)
    return m_all, s_all


@prepared_kernel
def tile_keys_kernel(
    logits_ptr,
    logits_row_stride,
    requested_ptr,
    counts_ptr,
    lse_ptr,
    cand_ptr,
    cand_row_stride,
    vocab_size,
    id_offset,
    k,
    BLOCK_SIZE: tl.constexpr,
    SELECT: tl.constexpr,
):
    """Per (row, tile): the tile's best 32 sort keys of the reported values (sorted)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    # 1. Zero flag, selected-ID rows (no natural alternatives) and k == 0 rows never read the
    #    vocabulary here and write nothing; the merge never reads their candidate slots.
    flag = tl.load(requested_ptr + row)
    count = tl.load(counts_ptr + row)
    if (flag == 0) | (count > 0) | (k == 0):
        return
    lanes = tile * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE).to(tl.int64)
    valid = lanes < vocab_size
    x = tl.load(logits_ptr + row * logits_row_stride + lanes, mask=valid, other=float("-inf"))
    lse = tl.load(lse_ptr + row)
    # 2. The reported value is exactly float32(x) - lse: the same FP32 subtraction the final
    #    pair stores, so ties created by the subtraction are ties in the key and fall back
    #    to the smaller id. A non-finite normalization reports the canonical NaN everywhere
    #    (all keys then tie on the value and the smallest ids win, as in the reference).
    value = x.to(tl.float32) - lse
    value = tl.where(is_finite(lse), value, canonical_nan())
    # 3. Global ids: id_offset is the shard's vocab_start (0 for a whole row).
    keys = sort_key(value, lanes + id_offset)
    # 4. Padded lanes become EMPTY_KEY, below every real key: they can only be "picked"
    #    once the real keys are exhausted, and then decode as id -1.
    keys = tl.where(valid, keys, EMPTY_KEY)
    best = top32(keys, SELECT)
    slots = tl.arange(0, NCAND)
    tl.store(cand_ptr + row * cand_row_stride + tile * NCAND + slots, best)


@triton.jit
def merge_candidate_rows(cand_row_ptr, n_cand, MERGE_BLOCK: tl.constexpr, SELECT: tl.constexpr):
    """Best 32 of ``n_cand`` contiguous int64 keys at ``cand_row_ptr`` (sorted)."""
    offs = tl.arange(0, MERGE_BLOCK)
    best = tl.full([NCAND], EMPTY_KEY, tl.int64)
    for start in range(0, n_cand, MERGE_BLOCK):
        c = start + offs
        chunk = tl.load(cand_row_ptr + c, mask=c < n_cand, other=EMPTY_KEY)
        best = merge_top32(best, chunk, SELECT)
    return best


@triton.jit
def store_natural_pairs(out_row_ptr, best, k):
    """Write pairs 0..k-1 from sorted keys ``best`` (EMPTY_KEY -> id -1, bits -1) and -1 into
    every later pair word of the 258-word payload row."""
    slots = tl.arange(0, NCAND)
    real = best != EMPTY_KEY
    ids = tl.where(real, key_token_id(best).to(tl.int32), -1)
    bits = tl.where(real, key_value_bits(best), -1)
    # 1. Only the first k pairs (k <= 20 < 32) come from the keys; the value is decoded from
    #    the key, so a zero reports +0.0 (signed zero was normalized for ordering).
    keep = slots < k
    tl.store(out_row_ptr + 2 + 2 * slots, ids, mask=keep)
    tl.store(out_row_ptr + 3 + 2 * slots, bits, mask=keep)
    fill_pairs(out_row_ptr, 2 * k)


@triton.jit
def fill_pairs(out_row_ptr, first_word):
    # 1. Pair words [first_word, 256) of the pair area become -1 (unused id -1, bits -1),
    #    exactly as the reference's out[row].fill_(-1) leaves them.
    words = tl.arange(0, PAIR_WORDS)
    minus_one = tl.full([PAIR_WORDS], -1, tl.int32)
    tl.store(out_row_ptr + 2 + words, minus_one, mask=words >= first_word)
