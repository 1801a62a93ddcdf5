"""Shard math of the sampler: global thresholds and the global pick, through small exchanges.

Every function takes the local shard's rows and a WordExchange (a size-1 group skips
communication). Every decision depends only on per-lane values that all tensor-parallel
layouts compute identically and on integer or exact-order reductions, so the result does not
depend on the shard layout. (The one caveat: exp and log are elementwise, but a SIMD lane and
a scalar tail may round them 1 ulp apart; that can only matter at an exact tie.)

Filters run in vLLM's order: min-p, top-k, top-p (see ranks/sampler.py). Tie rules
(TP-invariant because they use values and global ids only, never lane order):
- min-p: a lane is kept when exp(x - max) >= min_p (vLLM: softmax prob >= min_p * max prob).
- top-k: the threshold is the k-th largest value counted with multiplicity; every lane whose
  value equals the threshold is kept (so ties can keep more than k tokens), as in vLLM.
- top-p: over the lanes min-p and top-k kept, grouped by value; a value is kept when the
  probability mass of strictly larger values is < top_p of the total, so a tie at the
  boundary is kept whole (vLLM breaks it by sort order). Masses are integers (exp(x - max)
  in fixed point), whose sums do not depend on order; lanes already at -inf weigh 0.
- the pick: the largest score wins; equal scores pick the smallest global id.
"""

from __future__ import annotations

import math

import torch

from collectives.exchange import WordExchange
from kernels.philox import GUMBEL_SPAN, gumbel_noise, philox_bits, seed_words, uniform_of
from kernels.sortkeys import keys_to_words, ordered_high, ordered_high_to_float, words_to_keys

TOPK_WIDTH = 256
"""top-k up to this size: one exchange of each shard's best TOPK_WIDTH values (ordered words)."""

FILTER_WORDS = 256
"""Words per row per rank of the filter exchanges. Top-k/max exchange: the shard's best values
as ordered FP32 words (kernels.sortkeys.ordered_high), descending, then PAD_WORD. Radix round:
words (2b, 2b + 1) = (high, low) int32 halves of bucket b's int64 weight sum, then zeros."""

PICK_WORDS = 3
"""Final exchange, per row per rank: the shard's best score as an ordered 64-bit key in two
words (high, low), then the global id of that lane."""

RADIX_ROUNDS = ((25, 7), (18, 7), (11, 7), (4, 7), (0, 4))
"""(shift, bits) of each radix-select round over 32-bit value keys: at most 128 int64 buckets,
i.e. 256 words per row per rank."""

ROW_NOISE_MIN_WIDTH = 16384
"""Rows at least this wide with most lanes still candidates draw noise row by row."""

NO_KEY = -(2**63)
NO_ID = 2**31 - 1
PAD_WORD = -(2**31)
"""A top-k exchange slot holding no value: below the ordered word of -inf."""


def value_keys(x: torch.Tensor) -> torch.Tensor:
    """FP32 values -> int64 keys in [0, 2**32) with the same order (-0.0 equals +0.0)."""
    return ordered_high(x).to(torch.int64) + 2**31


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of value_keys (for -0.0 gives +0.0)."""
    return ordered_high_to_float((keys - 2**31).to(torch.int32))


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """float64 scores -> int64 with the same signed order (-0.0 maps like +0.0)."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).to(torch.float64)
    bits = s.contiguous().view(torch.int64)
    return torch.where(bits < 0, bits ^ (2**63 - 1), bits)


def _padded(words: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    out = torch.full((words.shape[0], width), fill, dtype=torch.int32, device=words.device)
    out[:, : words.shape[1]] = words
    return out


def max_and_topk(
    x: torch.Tensor, ks: torch.Tensor, exchange: WordExchange
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global max and k-th largest value (keys) of each row; ks[i] in 1..TOPK_WIDTH.

    One exchange: each shard sends its best min(max(ks), width) ordered words; the k-th
    largest of the union of the shards' top-k is the global k-th largest.
    """
    n, width = x.shape
    take = min(int(ks.max()), width) if n else 0
    local = torch.full((n, FILTER_WORDS), PAD_WORD, dtype=torch.int32, device=x.device)
    if take:
        local[:, :take] = ordered_high(torch.topk(x, take, dim=1, sorted=True).values)
    merged = exchange.gather(local, rows=n).permute(1, 0, 2).reshape(n, -1)
    merged = torch.sort(merged, dim=1, descending=True).values.to(torch.int64) + 2**31
    kth = merged.gather(1, (ks.to(torch.int64) - 1).unsqueeze(1)).squeeze(1)
    return merged[:, 0], kth


def radix_thresholds(
    keys: torch.Tensor,
    weights: torch.Tensor,
    targets: torch.Tensor,
    relative: bool,
    exchange: WordExchange,
) -> torch.Tensor:
    """Per row, the largest key v with W(v) >= target, W(v) = global weight of keys >= v.

    keys: int64 [rows, width] in [0, 2**32); weights: int64 >= 0, summing below 2**62 over
    the vocabulary; targets: float64 [rows], multiplied by the total weight when ``relative``.
    Unit weights give the k-th largest value; probability weights give the top-p boundary.
    Five exchanges of 128 int64 bucket sums each; integer sums make it layout-independent.
    """
    n = keys.shape[0]
    # Lanes of weight zero never change W, so they are dropped; after each round only the
    # lanes inside the chosen bucket matter (the ones above are summed into ``above``).
    row, lane = torch.nonzero(weights > 0, as_tuple=True)
    flat = row * keys.shape[1] + lane
    keys, weights = (t.reshape(-1).index_select(0, flat) for t in (keys, weights))
    prefix = torch.zeros(n, dtype=torch.int64, device=keys.device)
    above = torch.zeros_like(prefix)
    for shift, bits in RADIX_ROUNDS:
        buckets = 1 << bits
        bucket = (keys >> shift) & (buckets - 1)
        hist = torch.zeros(n * buckets, dtype=torch.int64, device=keys.device)
        hist = hist.scatter_add_(0, row * buckets + bucket, weights).view(n, buckets)
        local = _padded(keys_to_words(hist), FILTER_WORDS, 0)
        hist = words_to_keys(exchange.gather(local, rows=n)[:, :, : 2 * buckets]).sum(0)
        if relative and shift == RADIX_ROUNDS[0][0]:
            targets = targets * hist.sum(1).to(torch.float64)
        suffix = torch.nn.functional.pad(hist.flip(1).cumsum(1).flip(1), (0, 1))
        ok = (above.unsqueeze(1) + suffix[:, :buckets]).to(torch.float64) >= targets.unsqueeze(1)
        chosen = (ok.sum(1) - 1).clamp(min=0)
        above = above + suffix.gather(1, (chosen + 1).unsqueeze(1)).squeeze(1)
        prefix = (prefix << bits) | chosen
        inside = torch.nonzero(bucket == chosen.index_select(0, row)).squeeze(1)
        row, keys, weights = (t.index_select(0, inside) for t in (row, keys, weights))
    return prefix


def probability_weights(x: torch.Tensor, row_max: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """exp(x - max) in fixed point with 62 - ceil(log2 V) fraction bits (sum < 2**62)."""
    scale = 2.0 ** (62 - max(1, (vocab_size - 1).bit_length()))
    return (relative_probs(x, row_max) * scale).floor_().to(torch.int64)


def relative_probs(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """float64 exp(x - max); lanes equal to the max give 1 (also when the max is +inf)."""
    xd = x.to(torch.float64)
    m = row_max.to(torch.float64).unsqueeze(1)
    return torch.where(xd == m, 1.0, torch.exp(xd - m))


def greedy_best(x: torch.Tensor, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local argmax (first lane on ties = smallest global id): (float64 score, global id)."""
    if x.shape[1] == 0:
        return _empty_best(x.shape[0], x.device)
    lane = torch.argmax(x, dim=1)
    score = x.gather(1, lane.unsqueeze(1)).squeeze(1).to(torch.float64)
    return score_keys(score), lane + vocab_start


def gumbel_best(
    x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local Gumbel-max of float64(x) + noise(seed, position, global id): (score key, id).

    Noise lies in [GUMBEL_MIN, GUMBEL_MAX], so a lane more than GUMBEL_SPAN below the row's
    local max can never beat the max lane's score; the margin keeps that strict after float64
    rounding, so skipping such lanes never changes the winner. Lanes that remain draw noise
    in one flat call with per-lane keys, except in wide rows where most lanes remain: those
    draw their Philox bits row by row with scalar keys and evaluate the noise exactly only
    where it can still decide the winner (dense_row_best).
    """
    n, width = x.shape
    best, best_id = _empty_best(n, x.device)
    if width == 0:
        return best, best_id
    xmax = x.max(dim=1).values.to(torch.float64)
    margin = 1e-9 + 1e-12 * xmax.abs()
    cutoff = torch.where(torch.isfinite(xmax), xmax - GUMBEL_SPAN - margin, xmax)
    # Compare in float32 against the cutoff rounded down: a superset of the float64 test.
    low = cutoff.to(torch.float32)
    low = torch.where(low.to(torch.float64) > cutoff, torch.nextafter(low, low - 1), low)
    candidates = x >= low.unsqueeze(1)
    sparse = (candidates.sum(dim=1) * 2 <= width) | (width < ROW_NOISE_MIN_WIDTH)
    for i in torch.nonzero(~sparse).flatten().tolist():
        key, lane = dense_row_best(x[i], int(seeds[i]), int(positions[i]), vocab_start,
                                   float(xmax[i]))
        best[i], best_id[i] = key, lane + vocab_start
    row, lane = torch.nonzero(candidates & sparse.unsqueeze(1), as_tuple=True)
    if row.numel():
        ids = lane + vocab_start
        key = score_keys(
            x[row, lane].to(torch.float64) + gumbel_noise(seeds[row], positions[row], ids)
        )
        best.scatter_reduce_(0, row, key, reduce="amax")
        tied = torch.where(key == best[row], ids, NO_ID)
        best_id.scatter_reduce_(0, row, tied, reduce="amin")
    return best, best_id


DENSE_X_LIMIT = 1e6
"""Rows whose largest |logit| exceeds this draw every lane's noise exactly (the pruning
margins below assume scores of moderate size)."""

_BAND_SHIFT = 21
"""A lane's noise band: the FP32 bits of q = 2**52 - m shifted right by 21, i.e. q's
exponent and its two leading mantissa bits (four bands per octave of 1 - u)."""


def _band_bounds() -> torch.Tensor:
    """FP32 [4 * 256]: for every band of FP32(q), an upper bound (rounded up, plus 1e-6) of
    the noise -log(-log(u)) of any lane whose FP32(q) falls in it, u = 1 - (q - 0.5) / 2**52.
    The noise decreases with q. A band's lowest q is a power of two times 1, 1.25, 1.5 or
    1.75, exact in FP32, so rounding q to FP32 never moves it below its own band, and moves
    it at most one band up: each entry holds the bound of the band below it. (Looking up
    q - 1 instead of q only ever lands in the same band or a lower one, whose bound is
    larger; q - 1 = 0 lands in entry 0, which exceeds every noise.)"""
    table = [GUMBEL_SPAN + 40.0] * (4 * 256)
    edges = []
    for exponent in range(53):  # q in [1, 2**52]
        for quarter in range(4):
            q_low = 2.0**exponent * (1 + quarter / 4)
            if q_low > 2.0**52:
                break
            edges.append(((127 + exponent) << 2 | quarter, q_low))
    for (index, _), (_, below) in zip(edges[1:], edges, strict=False):
        d = (below - 0.5) * 2.0**-52
        table[index] = -math.log(-math.log1p(-d)) + 1e-6
    bounds = torch.tensor(table, dtype=torch.float64)
    rounded = bounds.to(torch.float32)
    up = torch.nextafter(rounded, torch.full_like(rounded, math.inf))
    return torch.where(rounded.to(torch.float64) < bounds, up, rounded)


_BANDS = _band_bounds()
_LANE_IDS: dict[tuple, torch.Tensor] = {}


def _lane_ids(start: int, width: int, device: torch.device) -> torch.Tensor:
    key = (start, width, str(device))
    ids = _LANE_IDS.get(key)
    if ids is None:
        if len(_LANE_IDS) > 8:
            _LANE_IDS.clear()
        ids = _LANE_IDS[key] = torch.arange(start, start + width, device=device)
    return ids


def dense_row_best(x: torch.Tensor, seed: int, position: int, vocab_start: int,
                   xmax: float) -> tuple[int, int]:
    """(best score key, its lane) of one row of float32 values [width]: the lane whose
    float64(x) + noise(seed, position, vocab_start + lane) has the largest score key, the
    smallest lane among equal keys, exactly as evaluating every lane's noise would pick.

    Every lane's Philox bits m are drawn (no lane can be skipped without them). Its noise
    is bounded above by its band's bound G (_band_bounds), so x + G bounds its score. The
    lanes whose bound is within 1 of the largest bound B get their exact scores; s* is the
    best of them, a score some lane reaches. A lane can only win if x + G >= s*; in FP32,
    with a margin of 2**-20 (1 + |s*|) that covers every rounding (|scores| <= DENSE_X_LIMIT
    + 40, G includes 1e-6 over float64 noise), the test keeps all of them, and they are all
    within 1 of B unless s* < B - 1 + margin (then the test is repeated over every lane).
    """
    width = x.shape[0]
    dev = x.device
    k0, k1 = seed_words(seed)
    m = philox_bits(_lane_ids(vocab_start, width, dev), position, k0, k1, clean=True)
    if not math.isfinite(xmax) or abs(xmax) > DENSE_X_LIMIT or vocab_start + width > 2**31:
        return _exact_best(x, m, torch.arange(width, device=dev))
    # q - 1 = (2**52 - 1) - m = m ^ (2**52 - 1): one band lower at most, a larger bound.
    q = torch.bitwise_xor(m, 2**52 - 1).to(torch.float32).view(torch.int32)
    bound = _BANDS.to(dev).index_select(0, q.bitwise_right_shift_(_BAND_SHIFT)).add_(x)
    near = float(bound.max()) - 1.0
    lanes = torch.nonzero(bound >= near).flatten()
    keys = _exact_keys(x, m, lanes)
    s_star = key_scores(int(keys.max()))
    floor = s_star - 2.0**-20 * (1.0 + abs(s_star))
    threshold = float(torch.tensor(floor, dtype=torch.float64).to(torch.float32))
    if threshold > floor:
        threshold = math.nextafter(threshold, -math.inf)
    if threshold < near:
        lanes = torch.nonzero(bound >= threshold).flatten()
        keys = _exact_keys(x, m, lanes)
    best = int(keys.max())
    return best, int(lanes[keys == best].min())


def _exact_keys(x: torch.Tensor, m: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Score keys of `lanes`, exactly as gumbel_noise and score_keys compute them."""
    noise = uniform_of(m[lanes]).log_().neg_().log_().neg_()
    return score_keys(x[lanes].to(torch.float64) + noise)


def _exact_best(x: torch.Tensor, m: torch.Tensor, lanes: torch.Tensor) -> tuple[int, int]:
    """(largest score key, smallest lane with it) among `lanes`."""
    keys = _exact_keys(x, m, lanes)
    best = int(keys.max())
    return best, int(lanes[keys == best].min())


def key_scores(key: int) -> float:
    """Inverse of score_keys for one key."""
    bits = key ^ (2**63 - 1) if key < 0 else key
    return torch.tensor(bits, dtype=torch.int64).view(torch.float64).item()


def _empty_best(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((n,), NO_KEY, dtype=torch.int64, device=device),
        torch.full((n,), NO_ID, dtype=torch.int64, device=device),
    )


def pick_global(keys: torch.Tensor, ids: torch.Tensor, exchange: WordExchange) -> torch.Tensor:
    """One exchange of each shard's best (score key, id): max key, then the smallest id."""
    n = keys.shape[0]
    local = torch.cat((keys_to_words(keys.unsqueeze(1)), ids.to(torch.int32).unsqueeze(1)), 1)
    gathered = exchange.gather(local, rows=n)
    all_keys = words_to_keys(gathered[:, :, :2]).squeeze(2)
    all_ids = gathered[:, :, 2].to(torch.int64)
    best = all_keys.max(dim=0).values
    return torch.where(all_keys == best, all_ids, NO_ID).min(dim=0).values
