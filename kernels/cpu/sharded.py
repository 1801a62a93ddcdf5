"""Torch step functions of the vocabulary-sharded reduction (six launches, CPU path).

The backend-agnostic driver (kernels/sharded.py) calls, per position block:
  shard_stats      launches 1-2: tile (max, mass), then the shard's (max, mass) -> exchange 1
  shard_candidates launch 3: global lse from exchange 1 in rank order;
                   launch 4: tiles' best 32 keys (global ids) or owned selected raw logits;
                   launch 5: shard merge -> exchange 2 words
  final_merge      launch 6: the gathered candidates -> the packed payload, same on every rank
kernels/triton/sharded.py implements the same three functions (kernels.backends.ShardSteps).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from helios_logprobs.kernels.cpu import lean as torch_lean
from helios_logprobs.kernels.cpu.lean import NumpyRequest, natural_best
from helios_logprobs.kernels.cpu.lean_stats import (
    Candidates,
    lean_combine,
    lean_tile_stats,
    native_values,
)
from helios_logprobs.kernels.cpu.tiles import (
    CHUNK_LANES,
    NEG_INF,
    TILE_LANES,
    TileStats,
    chunk_max,
    combine,
    count_rows,
    lse_from,
    slab_of,
    slabs,
    tile_candidates,
    tile_stats,
)
from helios_logprobs.kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
    TILE_CANDIDATES,
)
from helios_logprobs.kernels.payload import (
    assemble_payload,
    flagged_rows,
    pick_rows,
    top_keys,
    write_rows,
)
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sortkeys import (
    EMPTY_KEY,
    LOW_MASK,
    bits_to_float,
    float_bits,
    keys_to_words,
    words_to_keys,
)

KEY_WORDS = 2 * TILE_CANDIDATES
"""Exchange 2 words 1..64 carry the shard's best 32 keys in natural mode."""

_NEG_INF_BITS = -8388608  # float_bits(-inf) = 0xFF800000
_EMPTY_HIGH = np.int32(-(2**31))  # the high word of EMPTY_KEY (its low word is 0)


def _rows_index(rows: torch.Tensor | None, total: int, device: torch.device) -> torch.Tensor:
    return torch.arange(total, device=device) if rows is None else rows


def chunk_maxima(
    logits: torch.Tensor, rows: torch.Tensor | None, valid: int, tile: int = TILE_LANES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_max, tail_max) as launch 1 records them, from the native logits."""
    n = count_rows(rows, logits.shape[0])
    full, rest = divmod(valid, tile)
    dev = logits.device
    cmax = torch.empty(n, full, tile // CHUNK_LANES, dtype=torch.float32, device=dev)
    body = rest // CHUNK_LANES * CHUNK_LANES
    tail = torch.empty(n, body // CHUNK_LANES, dtype=torch.float32, device=dev)
    for r0, r1, t0, t1, lanes in slabs(n, full * tile + body, tile):
        x = slab_of(logits, rows, r0, r1, t0 * tile, t0 * tile + (t1 - t0) * lanes)
        c = chunk_max(x.view(r1 - r0, t1 - t0, lanes)).to(torch.float32)
        if lanes == tile:
            cmax[r0:r1, t0:t1] = c
        else:
            tail[r0:r1] = c[:, 0]
    return cmax, tail


def shard_stats(
    logits: torch.Tensor, request: RowRequest, local_valid: int, e1_out: torch.Tensor
) -> None:
    """Launches 1-2 on this shard. e1_out int32 [rows, 3] (exchange 1 send words; word 2,
    the entropy term, is kernels/entropy.py's and stays untouched here):
    word 0 = the shard's FP32 max bits, word 1 = its exp mass relative to that max (bits).
    A shard with no valid lanes, and every unflagged row, reports (-inf, 0)."""
    if torch_lean.LEAN and logits.device.type == "cpu" and local_valid > 0:
        _stats_lean(logits, request, local_valid, e1_out.numpy())
        return
    e1_out[:, 0] = _NEG_INF_BITS
    e1_out[:, 1] = 0
    rows = flagged_rows(request.requested != 0)
    if local_valid <= 0 or (rows is not None and rows.numel() == 0):
        return
    stats = tile_stats(logits, rows, local_valid)
    big, mass = combine(stats.max, stats.mass)
    write_rows(e1_out[:, :2], rows, torch.stack((float_bits(big), float_bits(mass)), dim=1))


def global_lse(e1_all: torch.Tensor) -> torch.Tensor:
    """Exchange 1 [world, rows, 3] (words 0-1 read) -> FP32 lse [rows], combined sequentially
    in rank order so that every rank computes bit-identical values (NaN when non-finite)."""
    big_all = bits_to_float(e1_all[..., 0])
    mass_all = bits_to_float(e1_all[..., 1])
    if e1_all.shape[0] == 1:
        # One rank: its weight is exp(0) = 1, or 0 (max -inf, mass 0) or NaN (max +inf or
        # NaN, mass NaN) exactly when the lse is non-finite anyway.
        return lse_from(big_all[0], mass_all[0])
    big = big_all.amax(0)
    shift = torch.where(big == NEG_INF, torch.zeros_like(big), big)
    # 1. A rank with max -inf (empty shard) adds 0 * exp(-inf) = 0, exactly.
    mass = torch.zeros_like(big)
    for r in range(e1_all.shape[0]):
        mass = mass + mass_all[r] * torch.exp(big_all[r] - shift)
    return lse_from(big, mass)


def shard_candidates(
    logits: torch.Tensor,
    request: RowRequest,
    e1_all: torch.Tensor,
    vocab_start: int,
    local_valid: int,
    lse_out: torch.Tensor,
    e2_out: torch.Tensor,
) -> None:
    """Launches 3-5. lse_out FP32 [rows]; e2_out int32 [rows, 129] (exchange 2 send words):
      word 0      the chosen token's raw logit FP32 bits if this shard owns it, else 0
      natural row (count 0): words 1..64 = the shard's best 32 keys as (high, low) halves,
                  EMPTY_KEY halves where the shard has fewer lanes; words 65..128 = 0
      selected row: word 1 + j = raw logit bits of selected id j if owned here, else 0
    Unflagged rows are all zero."""
    lse_out.copy_(global_lse(e1_all))
    e2_out.zero_()
    if torch_lean.LEAN and logits.device.type == "cpu" and local_valid > 0:
        _candidates_lean(logits, request, vocab_start, local_valid, lse_out.numpy(),
                         e2_out.numpy())
        return
    dev = logits.device
    ids, counts = request.ids, request.counts
    live = request.requested != 0
    end = vocab_start + local_valid
    c = request.chosen.to(torch.int64)
    own = (live & (c >= vocab_start) & (c < end)).nonzero().flatten()
    if own.numel():
        raw = logits[own, c[own] - vocab_start].to(torch.float32)
        e2_out[own, 0] = float_bits(raw)
    natural = (live & (counts == 0)).nonzero().flatten()
    if natural.numel():
        if local_valid > 0:
            rows = None if natural.numel() == logits.shape[0] else natural
            # 2. Launch 4 recomputes the chunk maxima launch 1 found (no state between steps).
            cmax, tail = chunk_maxima(logits, rows, local_valid)
            cand = tile_candidates(
                logits, rows, local_valid, lse_out[natural], cmax, tail, vocab_start
            )
            # 3. Launch 5: the shard keeps its best 32 of all its tiles' candidates.
            best = top_keys(cand.flatten(1), TILE_CANDIDATES)
        else:
            best = torch.full((natural.numel(), TILE_CANDIDATES), EMPTY_KEY, device=dev)
        e2_out[natural, 1 : 1 + KEY_WORDS] = keys_to_words(best)
    picked = (live & (counts > 0)).nonzero().flatten()
    if picked.numel() and local_valid > 0:
        sel = ids[picked].to(torch.int64)
        j = torch.arange(MAX_TOKEN_IDS, device=dev)
        mine = (j < counts[picked].unsqueeze(1)) & (sel >= vocab_start) & (sel < end)
        lane = (sel - vocab_start).clamp(0, local_valid - 1)
        raw = logits[picked.unsqueeze(1), lane].to(torch.float32)
        e2_out[picked, 1:] = torch.where(mine, float_bits(raw), 0)


def final_merge(
    e2_all: torch.Tensor,
    lse: torch.Tensor,
    request: RowRequest,
    shard_starts: list[int],
    out: torch.Tensor,
) -> None:
    """Launch 6: exchange 2 [world, rows, 129] -> packed rows of out (flagged rows only)."""
    if torch_lean.LEAN and out.device.type == "cpu":
        _merge_lean(e2_all.numpy(), lse.numpy(), request, list(shard_starts), out.numpy())
        return
    rows = flagged_rows(request.requested != 0)
    total = out.shape[0]
    dev = out.device
    r = _rows_index(rows, total, dev)
    n = r.numel()
    if n == 0:
        return
    world = e2_all.shape[0]
    bounds = torch.tensor(shard_starts[1:world], dtype=torch.int64, device=dev)
    # 4. Owner of id = the rank r with starts[r] <= id < starts[r + 1]; empty shards have
    #    equal bounds, and right=True skips them.
    c = pick_rows(request.chosen, rows).to(torch.int64)
    owner = torch.bucketize(c, bounds, right=True)
    chosen_values = bits_to_float(e2_all[owner, r, 0]) - lse[r]
    cnt = pick_rows(request.counts, rows)
    natural = (cnt == 0).nonzero().flatten()
    best = None
    k = request.k
    if k > 0 and natural.numel():
        keys = words_to_keys(e2_all[:, r[natural], 1 : 1 + KEY_WORDS])  # [world, m, 32]
        best = top_keys(keys.transpose(0, 1).flatten(1), k)
    picked = (cnt > 0).nonzero().flatten()
    sel = pick_rows(request.ids, rows)[picked].to(torch.int64)
    who = torch.bucketize(sel, bounds, right=True)
    word = torch.arange(1, 1 + MAX_TOKEN_IDS, device=dev).expand_as(sel)
    values = bits_to_float(e2_all[who, r[picked].unsqueeze(1), word]) - lse[r[picked]].unsqueeze(1)
    payload = assemble_payload(c, chosen_values, natural, best, picked, sel, cnt[picked], values)
    write_rows(out, rows, payload)


# ----------------------------------------------------------------------------- CPU fast path
#
# On CPU tensors the three steps run kernels/cpu/lean.py's launches (the same slabs, far
# fewer tensor ops, numpy bookkeeping) with bit-identical results. Launch 4 reuses what
# launches 1-2 found for the same logits (same storage and version) and the same rows:
# the chunk maxima (or a one-tile row's candidates), instead of recomputing them.


class _Found(threading.local):
    def __init__(self) -> None:
        self.key: tuple | None = None
        self.stats: TileStats | None = None
        self.picks: Candidates | None = None


_FOUND = _Found()


def _logits_key(logits: torch.Tensor, rows: np.ndarray, valid: int) -> tuple:
    return (logits.data_ptr(), logits._version, tuple(logits.shape), logits.stride(),
            str(logits.dtype), rows.tobytes(), valid)


def _stats_lean(logits: torch.Tensor, request: RowRequest, local_valid: int,
                e1: np.ndarray) -> None:
    e1[:, 0] = _NEG_INF_BITS
    e1[:, 1] = 0
    req = NumpyRequest(request)
    rows = np.flatnonzero(req.requested)
    _FOUND.key = None
    if not rows.size:
        return
    natural = not req.counts[rows].any()
    stats, picks = lean_tile_stats(logits, rows, local_valid, TILE_LANES, select=natural)
    big, mass = lean_combine(stats)
    e1[rows, 0] = big.view(np.int32)
    e1[rows, 1] = mass.numpy().view(np.int32)
    if natural:
        # (copies: a StatsPlan's buffers are reused by the next call on the same plan)
        _FOUND.key = _logits_key(logits, rows, local_valid)
        _FOUND.stats = TileStats(stats.max, stats.mass, stats.chunk_max.clone(),
                                 stats.tail_max.clone())
        _FOUND.picks = picks


def _words_of(ids: np.ndarray, values: np.ndarray, id_base: int) -> np.ndarray:
    """int32 [m, KEY_WORDS]: the sort keys of (ids + id_base, values) as keys_to_words
    writes them (high, low); EMPTY_KEY words where ids < 0 and beyond the list."""
    m, take = ids.shape
    pairs = np.empty((m, TILE_CANDIDATES, 2), np.int32)
    bits = values.view(np.int32)
    high = np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    low = (np.int64(LOW_MASK) - (ids + id_base)).astype(np.uint32).view(np.int32)
    empty = ids < 0
    pairs[:, :take, 0] = np.where(empty, _EMPTY_HIGH, high)
    pairs[:, :take, 1] = np.where(empty, 0, low)
    pairs[:, take:, 0] = _EMPTY_HIGH
    pairs[:, take:, 1] = 0
    return pairs.reshape(m, KEY_WORDS)


def _candidates_lean(logits: torch.Tensor, request: RowRequest, vocab_start: int,
                     local_valid: int, lse: np.ndarray, e2: np.ndarray) -> None:
    req = NumpyRequest(request)
    live = req.requested != 0
    end = vocab_start + local_valid
    chosen = req.chosen.astype(np.int64)
    own = np.flatnonzero(live & (chosen >= vocab_start) & (chosen < end))
    if own.size:
        e2[own, 0] = native_values(logits, own, chosen[own, None] - vocab_start).view(
            np.int32)[:, 0]
    natural = np.flatnonzero(live & (req.counts == 0))
    if natural.size:
        key, stats, picks = _FOUND.key, _FOUND.stats, _FOUND.picks
        if key != _logits_key(logits, natural, local_valid):
            stats, picks = lean_tile_stats(logits, natural, local_valid, TILE_LANES, True)
        best, _ = natural_best(logits, natural, local_valid, stats, picks, lse[natural],
                               TILE_CANDIDATES)
        e2[natural, 1 : 1 + KEY_WORDS] = _words_of(best.ids, best.values, vocab_start)
    _FOUND.key = _FOUND.stats = _FOUND.picks = None
    picked = np.flatnonzero(live & (req.counts > 0))
    if picked.size:
        sel = req.ids[picked].astype(np.int64)
        mine = (np.arange(MAX_TOKEN_IDS) < req.counts[picked, None]) & (sel >= vocab_start)
        mine &= sel < end
        lanes = np.clip(sel - vocab_start, 0, local_valid - 1)
        bits = native_values(logits, picked, lanes).view(np.int32)
        e2[picked, 1:] = np.where(mine, bits, 0)


def _merge_lean(e2_all: np.ndarray, lse: np.ndarray, request: RowRequest,
                shard_starts: list[int], out: np.ndarray) -> None:
    req = NumpyRequest(request)
    r = np.flatnonzero(req.requested)
    n = r.size
    if not n:
        return
    world = e2_all.shape[0]
    bounds = np.asarray(shard_starts[1:world], dtype=np.int64)
    lse_r = lse[r]
    bad = np.isnan(lse_r)
    bad = bad if bad.any() else None
    payload = np.empty((n, PAYLOAD_WORDS), np.int32)
    c = req.chosen[r].astype(np.int64)
    # 4. Owner of id = the rank r with starts[r] <= id < starts[r + 1]; empty shards have
    #    equal bounds, and side="right" skips them (torch.bucketize(right=True)).
    owner = np.searchsorted(bounds, c, side="right")
    chosen = e2_all[owner, r, 0].view(np.float32) - lse_r
    if bad is not None:
        chosen[bad] = lse_r[bad]  # torch's x - lse returns lse's (canonical) NaN
    payload[:, CHOSEN_ID] = c
    payload[:, CHOSEN_BITS] = chosen.view(np.int32)
    pairs = payload[:, FIRST_PAIR:].reshape(n, MAX_TOKEN_IDS, 2)
    pairs[:] = -1
    counts = req.counts[r]
    k = req.k
    natural = np.flatnonzero(counts == 0)
    if k and natural.size:
        words = e2_all[:, r[natural], 1 : 1 + KEY_WORDS].reshape(world, -1, TILE_CANDIDATES, 2)
        keys = (words[..., 0].astype(np.int64) << 32) | (words[..., 1].astype(np.int64)
                                                         & LOW_MASK)
        keys = keys.transpose(1, 0, 2).reshape(-1, world * TILE_CANDIDATES)
        best = np.sort(keys, axis=1)[:, ::-1][:, :k]
        empty = best == EMPTY_KEY
        top = (best >> 32).astype(np.int32)
        got = np.empty((best.shape[0], k, 2), np.int32)
        got[..., 0] = np.where(empty, -1, LOW_MASK - (best & LOW_MASK))
        got[..., 1] = np.where(empty, -1, np.where(top < 0, top ^ np.int32(0x7FFFFFFF), top))
        pairs[natural, :k] = got
    picked = np.flatnonzero(counts > 0)
    if picked.size:
        rp = r[picked]
        sel = req.ids[rp].astype(np.int64)
        who = np.searchsorted(bounds, sel, side="right")
        words = e2_all[who, rp[:, None], np.arange(1, 1 + MAX_TOKEN_IDS)]
        values = words.view(np.float32) - lse_r[picked, None]
        if bad is not None:
            values[bad[picked]] = np.float32(float("nan"))
        live = np.arange(MAX_TOKEN_IDS) < counts[picked, None]
        got = np.empty((picked.size, MAX_TOKEN_IDS, 2), np.int32)
        got[..., 0] = np.where(live, sel, -1)
        got[..., 1] = np.where(live, values.view(np.int32), -1)
        pairs[picked] = got
    out[r] = payload
