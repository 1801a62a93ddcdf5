"""Shard math of the sampler: global thresholds and the global pick, through small exchanges.

Every function takes the local shard's rows and a WordExchange (a size-1 group skips
communication). Every decision depends only on per-lane values that all tensor-parallel
layouts compute identically and on integer or exact-order reductions, so the result does not
depend on the shard layout. (The one caveat: exp and log are elementwise, but a SIMD lane and
a scalar tail may round them 1 ulp apart; that can only matter at an exact tie.)

Filters run in vLLM's order: min-p, top-k, top-p (see ranks/sampler/sampler.py). Tie rules
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

import torch

from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.kernels.radix.native import RadixLanes, fill_below, fill_min_p, top_values
from helios_logprobs.kernels.sortkeys import (
    keys_to_words,
    ordered_high,
    ordered_high_to_float,
    words_to_keys,
)

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
    x: torch.Tensor, ks: torch.Tensor, exchange: WordExchange, take: int | None = None,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global max and k-th largest value (keys) of each row; ks[i] in 1..TOPK_WIDTH.

    One exchange: each shard sends its best ``take`` = min(max(ks), width) ordered words
    (given by the caller, who knows ks on the host; else read from ks); the k-th largest of
    the union of the shards' top-k is the global k-th largest. native: compiled code may
    take the top values (the CPU).
    """
    n, width = x.shape
    if take is None:
        take = min(int(ks.max()), width) if n else 0
    local = torch.full((n, FILTER_WORDS), PAD_WORD, dtype=torch.int32, device=x.device)
    if take == 1:  # (each row's maximum: amax is several times cheaper than topk(x, 1))
        local[:, :1] = ordered_high(x.amax(dim=1, keepdim=True))
    elif take:
        top = top_values(x, take) if native else None  # (compiled, on the CPU: a heap per row)
        if top is None:
            top = torch.topk(x, take, dim=1, sorted=True).values
        local[:, :take] = ordered_high(top)
    merged = exchange.gather(local, rows=n).permute(1, 0, 2).reshape(n, -1)
    merged = torch.sort(merged, dim=1, descending=True).values.to(torch.int64) + 2**31
    kth = merged.gather(1, (ks.to(torch.int64) - 1).unsqueeze(1)).squeeze(1)
    return merged[:, 0], kth


def remove_below_kth(x: torch.Tensor, kth: torch.Tensor, small: torch.Tensor,
                     native: bool = True) -> None:
    """Set the lanes of rows x below their row's k-th largest value (kth: keys, as
    max_and_topk returns them) to -inf, in the rows where `small` (bool [rows]) is set. A key
    test is the value test: keys keep the FP32 order and give -0.0 the key of +0.0, and the
    scratch holds no NaN (a cut of 0 leaves a row alone)."""
    if not (native and fill_below(x, torch.where(small, kth, 0))):
        kept = torch.where(small, key_values(kth), float("-inf"))
        x.masked_fill_(x < kept.unsqueeze(1), float("-inf"))


def remove_below_min_p(x: torch.Tensor, row_max: torch.Tensor, floors: torch.Tensor,
                       native: bool = True) -> None:
    """Set the lanes of rows x whose relative_probs are below their row's floor (float64
    [rows], min_p in (0, 1]) to -inf, in place."""
    if not (native and fill_min_p(x, row_max, floors, checked=True)):
        x.masked_fill_(relative_probs(x, row_max) < floors.unsqueeze(1), float("-inf"))


class TorchRadixLanes:
    """A block's lanes for radix_thresholds, dense: keys int64 [rows, width] in [0, 2**32) and
    weights int64 >= 0 of the same shape (on the block's device). Every round keeps the
    shapes (a lane outside the chosen bucket gets weight 0 instead of leaving), so no round
    reads a count on the host: the sums are those of the lanes left, exactly (integers)."""

    def __init__(self, keys: torch.Tensor, weights: torch.Tensor) -> None:
        self.block_keys = keys
        self.keys, self.weights = keys, weights
        self.rows = keys.shape[0]

    def histogram(self, shift: int, bits: int,
                  previous: tuple[int, int, torch.Tensor] | None) -> torch.Tensor:
        """int64 [rows, 2**bits]: the weight in each bucket of bits [shift, shift + bits) of
        the lanes left, after dropping those outside previous = (shift, bits, chosen bucket
        per row) of the round before."""
        if previous is not None:
            keep_shift, keep_bits, chosen = previous
            bucket = (self.keys >> keep_shift) & ((1 << keep_bits) - 1)
            self.weights = torch.where(bucket == chosen.unsqueeze(1), self.weights, 0)
        buckets = 1 << bits
        bucket = (self.keys >> shift) & (buckets - 1)
        hist = torch.zeros(self.rows, buckets, dtype=torch.int64, device=self.keys.device)
        return hist.scatter_add_(1, bucket, self.weights)

    def below(self, cut: torch.Tensor) -> torch.Tensor:
        """bool [rows, width]: lanes whose key is below their row's cut."""
        return self.block_keys < cut.unsqueeze(1)

    def remove_below(self, block: torch.Tensor, cut: torch.Tensor) -> None:
        """Set block's lanes (the rows these keys came from) below their row's cut to -inf."""
        block.masked_fill_(self.below(cut), float("-inf"))


def radix_lanes(x: torch.Tensor, row_max: torch.Tensor | None,
                vocab_size: int, native: bool = True) -> TorchRadixLanes | RadixLanes:
    """The lanes of rows x (the sampler's FP32 scratch) for radix_thresholds: unit weights
    when row_max is None (the k-th largest value), else probability weights (the top-p
    boundary). Compiled code holds them on the CPU where it applies and ``native`` allows
    (kernels/radix)."""
    if native:
        lanes = RadixLanes.start(x, row_max, probability_scale(vocab_size))
        if lanes is not None:
            return lanes
    keys = value_keys(x)
    if row_max is None:
        return TorchRadixLanes(keys, torch.ones_like(keys))
    return TorchRadixLanes(keys, probability_weights(x, row_max, vocab_size))


def radix_thresholds(
    lanes: TorchRadixLanes | RadixLanes,
    targets: torch.Tensor,
    relative: bool,
    exchange: WordExchange,
) -> torch.Tensor:
    """Per row, the largest key v with W(v) >= target, W(v) = global weight of keys >= v.

    lanes: radix_lanes of the rows (weights summing below 2**62 over the vocabulary);
    targets: float64 [rows], multiplied by the total weight when ``relative``. Unit weights
    give the k-th largest value; probability weights give the top-p boundary. Five exchanges
    of 128 int64 bucket sums each; integer sums make it layout-independent. After each round
    only the lanes inside the chosen bucket matter (the ones above are summed into
    ``above``).
    """
    n = targets.shape[0]
    prefix = torch.zeros(n, dtype=torch.int64, device=targets.device)
    above = torch.zeros_like(prefix)
    previous = None
    for shift, bits in RADIX_ROUNDS:
        buckets = 1 << bits
        hist = lanes.histogram(shift, bits, previous).to(targets.device)
        local = _padded(keys_to_words(hist), FILTER_WORDS, 0)
        hist = words_to_keys(exchange.gather(local, rows=n)[:, :, : 2 * buckets]).sum(0)
        if relative and shift == RADIX_ROUNDS[0][0]:
            targets = targets * hist.sum(1).to(torch.float64)
        suffix = torch.nn.functional.pad(hist.flip(1).cumsum(1).flip(1), (0, 1))
        ok = (above.unsqueeze(1) + suffix[:, :buckets]).to(torch.float64) >= targets.unsqueeze(1)
        chosen = (ok.sum(1) - 1).clamp(min=0)
        above = above + suffix.gather(1, (chosen + 1).unsqueeze(1)).squeeze(1)
        prefix = (prefix << bits) | chosen
        previous = (shift, bits, chosen)
    return prefix


def probability_scale(vocab_size: int) -> float:
    """2**(62 - ceil(log2 V)): fixed-point probabilities of a row sum below 2**62."""
    return 2.0 ** (62 - max(1, (vocab_size - 1).bit_length()))


def probability_weights(x: torch.Tensor, row_max: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """exp(x - max) in fixed point with 62 - ceil(log2 V) fraction bits (sum < 2**62)."""
    return (relative_probs(x, row_max) * probability_scale(vocab_size)).floor_().to(torch.int64)


def relative_probs(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """float64 exp(x - max); lanes equal to the max give 1 (also when the max is +inf)."""
    xd = x.to(torch.float64)
    m = row_max.to(torch.float64).unsqueeze(1)
    return torch.where(xd == m, 1.0, torch.exp(xd - m))


def greedy_best(x: torch.Tensor, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local argmax (first lane on ties = smallest global id): (float64 score, global id)."""
    if x.shape[1] == 0:
        return empty_best(x.shape[0], x.device)
    lane = first_argmax(x)
    score = x.gather(1, lane.unsqueeze(1)).squeeze(1).to(torch.float64)
    return score_keys(score), lane + vocab_start


ARGMAX_TILE = 2048
"""Lanes per tile of first_argmax's CPU path."""
ARGMAX_TILED_FROM = 2**17
"""Elements from which first_argmax takes the tiled path on the CPU (below it, the few extra
launches cost more than torch.argmax's scalar loop)."""


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=1), int64 [rows]: the first lane holding the row's maximum (the first
    NaN when the row has one). On the CPU, torch.argmax runs a scalar loop (~1 ns per lane);
    for large rows it is cheaper to take tile maxima with the vectorized amax, find the first
    tile holding the row maximum, and search that tile alone. -0.0 == +0.0, so the first lane
    of either zero wins a tie between them, as in torch.argmax."""
    rows, width = x.shape
    tiles = width // ARGMAX_TILE
    if x.device.type != "cpu" or x.numel() < ARGMAX_TILED_FROM or tiles == 0:
        return torch.argmax(x, dim=1)
    tile_max = x[:, : tiles * ARGMAX_TILE].unflatten(1, (tiles, ARGMAX_TILE)).amax(2)
    if tiles * ARGMAX_TILE < width:
        tile_max = torch.cat((tile_max, x[:, tiles * ARGMAX_TILE :].amax(1, keepdim=True)), 1)
    best = tile_max.amax(1, keepdim=True)  # NaN when the row has one (amax propagates it)
    first_tile = torch.argmax(_holds(tile_max, best).to(torch.uint8), dim=1)
    start = first_tile * ARGMAX_TILE
    lanes = start.unsqueeze(1) + torch.arange(ARGMAX_TILE, device=x.device)
    lanes.clamp_(max=width - 1)  # (a short last tile repeats its last lane)
    found = _holds(x.gather(1, lanes), best)
    return start + torch.argmax(found.to(torch.uint8), dim=1)


def _holds(values: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    return (values == best) | values.isnan()


def empty_best(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((n,), NO_KEY, dtype=torch.int64, device=device),
        torch.full((n,), NO_ID, dtype=torch.int64, device=device),
    )


def pick_global(keys: torch.Tensor, ids: torch.Tensor, exchange: WordExchange) -> torch.Tensor:
    """One exchange of each shard's best (score key, id): max key, then the smallest id."""
    if exchange.world == 1:
        return ids
    n = keys.shape[0]
    local = torch.cat((keys_to_words(keys.unsqueeze(1)), ids.to(torch.int32).unsqueeze(1)), 1)
    gathered = exchange.gather(local, rows=n)
    all_keys = words_to_keys(gathered[:, :, :2]).squeeze(2)
    all_ids = gathered[:, :, 2].to(torch.int64)
    best = all_keys.max(dim=0).values
    return torch.where(all_keys == best, all_ids, NO_ID).min(dim=0).values
