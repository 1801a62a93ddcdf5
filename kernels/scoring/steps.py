"""Prompt scoring on vocabulary shards (torch path): per row, the actual token's logprob, its
rank over the whole vocabulary and the best 20 alternatives, with two 64-word exchanges.

Each rank holds logits [n <= 64, width] for global ids [vocab_start, vocab_start + width), of
which the first local_valid lanes are real vocabulary. ``targets`` [n] holds the actual
(next prompt) token of each row, or -1 (prompt end, image positions). Per row block:

  score_stats       tile (max, mass) -> the shard's (max, mass); the target's raw logit
                    from its owner                              -> exchange 1
  gather 1          [world, n, 64]: word 0 = shard max FP32 bits, word 1 = shard exp mass
                    FP32 bits, word 2 = the target's raw logit FP32 bits (owner's word is
                    read), words 3.. = 0
  score_candidates  global lse (rank order, bit-identical everywhere); the target's reported
                    value v = fp32(x_t) - lse; the shard's count of lanes whose reported
                    value is strictly greater than v; its best 20 sort keys -> exchange 2
  gather 2          [world, n, 64]: word 0 = the count, words 1..40 = 20 keys as (high, low)
                    halves, words 41.. = 0
  score_merge       rank = 1 + the summed counts; the best 20 of world x 20 keys -> the row

Row (int32, PROMPT_ROW_WORDS = 43): target id, FP32 logprob bits, rank, 20 (id, FP32 bits)
pairs in the generation ordering (value desc, id asc; ties made by the subtraction included).
An invalid row (target -1) is: -1, NaN, 0, and -1 for every pair word. 2 x 64 x 4 = 512 bytes
per row per rank; no vocabulary-sized row travels and no [rows, vocabulary] FP32 copy exists
(slabs of at most SLAB_ELEMENTS lanes, as in kernels/cpu/tiles.py).
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.cpu import lean as torch_lean
from helios_logprobs.kernels.cpu.sharded import global_lse
from helios_logprobs.kernels.cpu.tiles import (
    combine,
    slab_of,
    slabs,
    tile_candidates,
    tile_stats,
)
from helios_logprobs.kernels.layout import (
    PROMPT_BLOCK_ROWS,
    PROMPT_EXCHANGE_WORDS,
    PROMPT_FIRST_PAIR,
    PROMPT_K,
    PROMPT_RANK,
    PROMPT_ROW_WORDS,
    PROMPT_TARGET_BITS,
    PROMPT_TARGET_ID,
)
from helios_logprobs.kernels.payload import top_keys
from helios_logprobs.kernels.scoring.lean import ShardScan, best_keys, count_above_fast, scan_block
from helios_logprobs.kernels.sortkeys import (
    EMPTY_KEY,
    bits_to_float,
    float_bits,
    key_ids,
    key_values,
    keys_to_words,
    words_to_keys,
)

NAN_BITS = 0x7FC00000
_NEG_INF_BITS = -8388608  # float_bits(-inf)
KEY_WORDS = 2 * PROMPT_K


def score_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    local_valid: int,
    e1_out: torch.Tensor,
) -> ShardScan | None:
    """Exchange 1 words of this shard into e1_out [n, 64]; returns launch 1's findings (the
    chunk maxima prefilter the candidates), None for a shard without lanes. CPU tensors
    take kernels/scoring/lean.py's launches, which give the same words."""
    e1_out.zero_()
    e1_out[:, 0] = _NEG_INF_BITS
    if local_valid <= 0:
        return None
    if _lean(logits):
        scan = scan_block(logits, local_valid)
    else:
        scan = ShardScan(tile_stats(logits, None, local_valid), None)
    big, mass = combine(scan.stats.max, scan.stats.mass)
    e1_out[:, 0] = float_bits(big)
    e1_out[:, 1] = float_bits(mass)
    t = targets.to(torch.int64)
    own = ((t >= vocab_start) & (t < vocab_start + local_valid)).nonzero().flatten()
    if own.numel():
        e1_out[own, 2] = float_bits(logits[own, t[own] - vocab_start].to(torch.float32))
    return scan


def _lean(logits: torch.Tensor) -> bool:
    return torch_lean.LEAN and logits.device.type == "cpu"


def target_values(
    e1_all: torch.Tensor, targets: torch.Tensor, shard_starts: list[int], normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, v) FP32 [n]: the global normalization and each target's reported value (NaN for
    an invalid target), identical on every rank. ``normalize`` False (--logprobs-mode
    *_logits): a normalization of exactly 0 where the row has one (NaN stays NaN), so every
    reported value is the logit itself."""
    lse = global_lse(e1_all)
    if not normalize:
        lse = torch.where(torch.isfinite(lse), torch.zeros_like(lse), lse)
    t = targets.to(torch.int64)
    world = e1_all.shape[0]
    bounds = torch.tensor(shard_starts[1:world], dtype=torch.int64, device=t.device)
    owner = torch.bucketize(t.clamp(min=0), bounds, right=True)
    rows = torch.arange(t.numel(), device=t.device)
    value = bits_to_float(e1_all[owner, rows, 2]) - lse
    return lse, torch.where(t >= 0, value, torch.full_like(value, float("nan")))


def count_above(
    logits: torch.Tensor, local_valid: int, lse: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """int64 [n]: lanes of this shard whose reported value fp32(x) - lse exceeds ``value``
    strictly (a NaN value counts nothing), one FP32 slab at a time."""
    if _lean(logits):
        counts = count_above_fast(logits, local_valid, lse, value)
        if counts is not None:
            return counts
    n = logits.shape[0]
    counts = torch.zeros(n, dtype=torch.int64, device=logits.device)
    tile = max(1, min(local_valid, 4096))
    for r0, r1, t0, t1, lanes in slabs(n, local_valid, tile):
        x = slab_of(logits, None, r0, r1, t0 * tile, t0 * tile + (t1 - t0) * lanes)
        reported = x.to(torch.float32) - lse[r0:r1].unsqueeze(1)
        counts[r0:r1] += (reported > value[r0:r1].unsqueeze(1)).sum(1)
    return counts


def score_candidates(
    logits: torch.Tensor,
    scan: ShardScan | None,
    lse: torch.Tensor,
    value: torch.Tensor,
    vocab_start: int,
    local_valid: int,
    e2_out: torch.Tensor,
) -> None:
    """Exchange 2 words of this shard into e2_out [n, 64]: count, then 20 keys."""
    n = logits.shape[0]
    e2_out.zero_()
    if scan is None:
        best = torch.full((n, PROMPT_K), EMPTY_KEY, dtype=torch.int64, device=logits.device)
    else:
        e2_out[:, 0] = count_above(logits, local_valid, lse, value).to(torch.int32)
        if _lean(logits):
            best = best_keys(logits, scan, lse, vocab_start, local_valid)
        else:
            stats = scan.stats
            cand = tile_candidates(
                logits, None, local_valid, lse, stats.chunk_max, stats.tail_max, vocab_start
            )
            best = top_keys(cand.flatten(1), PROMPT_K)
        # A non-finite normalization (NaN or +inf logit) reports no alternatives.
        best = torch.where(torch.isfinite(lse).unsqueeze(1), best, EMPTY_KEY)
    e2_out[:, 1 : 1 + KEY_WORDS] = keys_to_words(best)


def score_merge(
    e2_all: torch.Tensor, targets: torch.Tensor, value: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Every shard's words -> the scored rows out int32 [n, 43], the same on every rank."""
    n = targets.numel()
    keys = words_to_keys(e2_all[:, :, 1 : 1 + KEY_WORDS])  # [world, n, 20]
    best = top_keys(keys.transpose(0, 1).flatten(1), PROMPT_K)
    empty = best == EMPTY_KEY
    out.fill_(-1)
    out[:, PROMPT_TARGET_ID] = targets.to(torch.int32)
    out[:, PROMPT_TARGET_BITS] = float_bits(value)
    out[:, PROMPT_RANK] = (1 + e2_all[:, :, 0].to(torch.int64).sum(0)).to(torch.int32)
    pairs = out[:, PROMPT_FIRST_PAIR:].view(n, PROMPT_K, 2)
    pairs[:, :, 0] = torch.where(empty, -1, key_ids(best)).to(torch.int32)
    pairs[:, :, 1] = torch.where(empty, -1, float_bits(key_values(best)))
    invalid = (targets < 0).nonzero().flatten()
    if invalid.numel():
        out[invalid] = -1
        out[invalid, PROMPT_TARGET_BITS] = NAN_BITS
        out[invalid, PROMPT_RANK] = 0
    return out


def check_block(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> int:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float [rows, width] tensor, got {logits.shape}")
    n = logits.shape[0]
    if n > PROMPT_BLOCK_ROWS:
        raise ValueError(f"logits: at most {PROMPT_BLOCK_ROWS} rows per block, got {n}")
    if targets.shape != (n,) or targets.dtype.is_floating_point:
        raise ValueError(f"targets: expected integer ({n},), got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if out.shape != (n, PROMPT_ROW_WORDS) or out.dtype != torch.int32:
        raise ValueError(f"out: expected int32 ({n}, {PROMPT_ROW_WORDS}), got {out.dtype} "
                         f"{tuple(out.shape)}")
    return n


assert 3 <= PROMPT_EXCHANGE_WORDS and 1 + KEY_WORDS <= PROMPT_EXCHANGE_WORDS
