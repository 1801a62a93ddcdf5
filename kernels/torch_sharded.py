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

from kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
    TILE_CANDIDATES,
)
from kernels.payload import assemble_payload, flagged_rows, pick_rows, top_keys, write_rows
from kernels.rows import RowRequest
from kernels.sortkeys import (
    EMPTY_KEY,
    LOW_MASK,
    bits_to_float,
    float_bits,
    keys_to_words,
    words_to_keys,
)
from kernels.torch_backend import (
    NEG_INF,
    TILE_LANES,
    Geometry,
    RowBlock,
    block_rows,
    chunk_maxima,
    combine,
    geometry,
    lse_from,
    natural_best,
    numpy_request,
    row_block,
    tile_candidates,
    tile_stats,
)

KEY_WORDS = 2 * TILE_CANDIDATES
"""Exchange 2 words 1..64 carry the shard's best 32 keys in natural mode."""

_NEG_INF_BITS = -8388608  # float_bits(-inf) = 0xFF800000
_EMPTY_HIGH = np.int32(-(2**31))  # the high word of EMPTY_KEY (its low word is 0)


def _rows_index(rows: torch.Tensor | None, total: int, device: torch.device) -> torch.Tensor:
    return torch.arange(total, device=device) if rows is None else rows


def shard_stats(
    logits: torch.Tensor, request: RowRequest, local_valid: int, e1_out: torch.Tensor
) -> None:
    """Launches 1-2 on this shard. e1_out int32 [rows, 2] (exchange 1 send words):
    word 0 = the shard's FP32 max bits, word 1 = its exp mass relative to that max (bits).
    A shard with no valid lanes, and every unflagged row, reports (-inf, 0)."""
    if logits.device.type == "cpu" and local_valid > 0:
        e1 = e1_out.numpy()
        e1[:, 0] = _NEG_INF_BITS
        e1[:, 1] = 0
        flagged = np.flatnonzero(request.requested.numpy())
        if not flagged.size:
            return
        per = _cpu_blocks(logits, flagged.size, local_valid)
        if per:
            _stats_np(logits, numpy_request(request), flagged, per, local_valid, e1)
            return
    e1_out[:, 0] = _NEG_INF_BITS
    e1_out[:, 1] = 0
    rows = flagged_rows(request.requested != 0)
    if local_valid <= 0 or (rows is not None and rows.numel() == 0):
        return
    stats = tile_stats(logits, rows, local_valid)
    big, mass = combine(stats.max, stats.mass)
    write_rows(e1_out, rows, torch.stack((float_bits(big), float_bits(mass)), dim=1))


def global_lse(e1_all: torch.Tensor) -> torch.Tensor:
    """Exchange 1 [world, rows, 2] -> FP32 lse [rows], combined sequentially in rank order so
    that every rank computes bit-identical values (NaN when non-finite)."""
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
    if logits.device.type == "cpu" and local_valid > 0:
        req = numpy_request(request)
        live = req.requested != 0
        per = _cpu_blocks(logits, int(live.sum()), local_valid)
        if per:
            _candidates_np(logits, req, live, per, vocab_start, local_valid, lse_out.numpy(),
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
    if out.device.type == "cpu":
        req = numpy_request(request)
        flagged = np.flatnonzero(req.requested)
        if flagged.size:
            _merge_np(e2_all.numpy(), lse.numpy(), req, flagged, list(shard_starts), out.numpy())
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
# On the CPU the three steps run whole-row blocks (kernels/torch_backend.py, RowBlock) with
# numpy views for the bookkeeping; launch 4 reuses the block that launches 1-2 loaded when
# the same logits (same storage, same version) and the same rows come back, instead of
# recomputing its chunk maxima. Results are bit-identical to the tile-by-tile steps below.


class _Loaded(threading.local):
    def __init__(self) -> None:
        self.block: RowBlock | None = None


_LOADED = _Loaded()


def _logits_key(logits: torch.Tensor, rows: np.ndarray, valid: int) -> tuple:
    return (logits.data_ptr(), logits._version, tuple(logits.shape), logits.stride(),
            str(logits.dtype), rows.tobytes(), valid)


def _cpu_blocks(logits: torch.Tensor, n: int, local_valid: int) -> int:
    """Rows per whole-row block for the CPU path, 0 to use the tile-by-tile steps."""
    if logits.device.type != "cpu" or local_valid <= 0:
        return 0
    return block_rows(n, local_valid, TILE_LANES, logits.device)


def _load(logits: torch.Tensor, rows: np.ndarray, geo: Geometry) -> RowBlock:
    block = row_block(rows.shape[0], geo)
    first, b = int(rows[0]), rows.shape[0]
    if int(rows[-1]) == first + b - 1:
        block.load(logits[first : first + b, : geo.valid])
    else:
        block.load(logits[:, : geo.valid].index_select(0, torch.from_numpy(rows)))
    return block


def _stats_np(logits: torch.Tensor, req, flagged: np.ndarray, per: int, local_valid: int,
              e1: np.ndarray) -> None:
    geo = geometry(local_valid, TILE_LANES)
    _LOADED.block = None
    single = flagged.size <= per
    # Launch 4 will want the candidates of these very rows when they are all natural.
    select = single and not req.counts[flagged].any()
    for r0 in range(0, flagged.size, per):
        rows = flagged[r0 : r0 + per]
        block = _load(logits, rows, geo)
        block.stats(select=select)
        big, mass = block.combine()
        e1[rows, 0] = big.view(np.int32)[:, 0]
        e1[rows, 1] = mass.numpy().view(np.int32)[:, 0]
    if select:
        block.owner = _logits_key(logits, flagged, local_valid)
        _LOADED.block = block


def _words_of(best_ids: np.ndarray, values: np.ndarray, id_base: int) -> np.ndarray:
    """int32 [m, KEY_WORDS]: the sort keys of (ids + id_base, values) as exchange words
    (high, low), as keys_to_words writes them; EMPTY_KEY words where ids < 0 or beyond the
    list."""
    m, take = best_ids.shape
    pairs = np.empty((m, TILE_CANDIDATES, 2), np.int32)
    bits = values.view(np.int32)
    high = np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    low = (np.int64(0xFFFFFFFF) - (best_ids + id_base)).astype(np.uint32).view(np.int32)
    empty = best_ids < 0
    pairs[:, :take, 0] = np.where(empty, _EMPTY_HIGH, high)
    pairs[:, :take, 1] = np.where(empty, 0, low)
    pairs[:, take:, 0] = _EMPTY_HIGH
    pairs[:, take:, 1] = 0
    return pairs.reshape(m, KEY_WORDS)


def _candidates_np(logits: torch.Tensor, req, live: np.ndarray, per: int, vocab_start: int,
                   local_valid: int, lse: np.ndarray, e2: np.ndarray) -> None:
    geo = geometry(local_valid, TILE_LANES)
    end = vocab_start + local_valid
    chosen = req.chosen.astype(np.int64)
    own = np.flatnonzero(live & (chosen >= vocab_start) & (chosen < end))
    natural = np.flatnonzero(live & (req.counts == 0))
    picked = np.flatnonzero(live & (req.counts > 0))
    loaded = _LOADED.block
    _LOADED.block = None
    if loaded is not None and loaded.owner != _logits_key(logits, natural, local_valid):
        loaded = None
    if own.size:
        raw = logits[torch.from_numpy(own), torch.from_numpy(chosen[own] - vocab_start)]
        e2[own, 0] = raw.to(torch.float32).numpy().view(np.int32)
    for r0 in range(0, natural.size, per):
        rows = natural[r0 : r0 + per]
        block = loaded
        if block is None:
            block = _load(logits, rows, geo)
            block.chunk_pass()
            block.select()
        lse_rows = lse[rows, None]
        best = natural_best(block, logits, rows, lse_rows, TILE_CANDIDATES, TILE_LANES)
        e2[rows, 1 : 1 + KEY_WORDS] = _words_of(best.ids, best.values, vocab_start)
    if picked.size:
        sel = req.ids[picked].astype(np.int64)
        mine = (np.arange(MAX_TOKEN_IDS) < req.counts[picked, None]) & (sel >= vocab_start)
        mine &= sel < end
        lanes = np.clip(sel - vocab_start, 0, local_valid - 1)
        raw = logits[torch.from_numpy(picked[:, None]), torch.from_numpy(lanes)]
        bits = raw.to(torch.float32).numpy().view(np.int32)
        e2[picked, 1:] = np.where(mine, bits, 0)


def _merge_np(e2_all: np.ndarray, lse: np.ndarray, req, flagged: np.ndarray,
              shard_starts: list[int], out: np.ndarray) -> None:
    world = e2_all.shape[0]
    bounds = np.asarray(shard_starts[1:world], dtype=np.int64)
    r, n = flagged, flagged.size
    first = int(r[0])
    consecutive = int(r[-1]) == first + n - 1
    payload = out[first : first + n] if consecutive else np.empty((n, PAYLOAD_WORDS), np.int32)
    lse_r = lse[r]
    bad = np.isnan(lse_r)
    bad = bad if bad.any() else None
    c = req.chosen[r].astype(np.int64)
    owner = np.searchsorted(bounds, c, side="right")
    chosen = e2_all[owner, r, 0].view(np.float32) - lse_r
    if bad is not None:
        chosen[bad] = lse_r[bad]  # torch's x - lse returns lse's (canonical) NaN
    payload[:, CHOSEN_ID] = c
    payload[:, CHOSEN_BITS] = chosen.view(np.int32)
    pairs = payload[:, FIRST_PAIR:].reshape(n, MAX_TOKEN_IDS, 2)
    counts = req.counts[r]
    k = req.k
    any_selected = bool(counts.any())
    pairs[:, 0 if any_selected else k :] = -1
    natural = np.flatnonzero(counts == 0) if any_selected else slice(None)
    if k and (not any_selected or natural.size):
        rows = r if not any_selected else r[natural]
        words = e2_all[:, rows, 1 : 1 + KEY_WORDS].reshape(world, -1, TILE_CANDIDATES, 2)
        high = words[..., 0].astype(np.int64)
        keys = (high << 32) | (words[..., 1].astype(np.int64) & LOW_MASK)
        keys = keys.transpose(1, 0, 2).reshape(-1, world * TILE_CANDIDATES)
        best = np.sort(keys, axis=1)[:, ::-1][:, :k]
        empty = best == EMPTY_KEY
        top = (best >> 32).astype(np.int32)
        bits = np.where(top < 0, top ^ np.int32(0x7FFFFFFF), top)
        got = np.empty((best.shape[0], k, 2), np.int32)
        got[..., 0] = np.where(empty, -1, LOW_MASK - (best & LOW_MASK))
        got[..., 1] = np.where(empty, -1, bits)
        pairs[natural, :k] = got
    if any_selected:
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
    if not consecutive:
        out[r] = payload
