"""CPU production path: the contract's four launches as plain torch functions.

1. ``tile_stats``     vocabulary tiles -> FP32 max and exp mass per (row, tile).
2. ``normalization``  small reduction -> per-row lse = M + log(S).
3. ``tile_candidates`` each tile's best 32 sort keys of the reported FP32 values (x - lse),
                      among the lanes that can still reach the row's best 32.
4. ``final_merge``    best K of the candidate keys + the chosen pair, or the selected IDs' raw
                      logits minus the same lse.

Memory: logits are read one slab at a time (whole tiles of a block of rows, at most
``SLAB_ELEMENTS`` lanes and at most a quarter of the rows x vocabulary product), so the
largest FP32 temporary is one slab; no [rows, vocabulary] FP32 copy ever exists. Launch 3
converts only the few chunks that reach a floor derived from launch 1's chunk maxima.
Only flagged rows are read: a row subset is index-selected per slab, never as whole rows.
The sharded steps (kernels/torch_sharded.py) reuse launches 1 and 3 on their shard.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from kernels.layout import CHOSEN_BITS, CHOSEN_ID, FIRST_PAIR, MAX_TOKEN_IDS, PAYLOAD_WORDS
from kernels.layout import TILE_CANDIDATES as TOP
from kernels.payload import assemble_payload, flagged_rows, pick_rows, top_keys, write_rows
from kernels.rows import RowRequest
from kernels.sortkeys import EMPTY_KEY, key_ids, key_values, make_keys

TILE_LANES = 4096
"""Vocabulary lanes per tile (a multiple of CHUNK_LANES)."""

CHUNK_LANES = 16
"""Lanes per chunk of the launch-3 prefilter: a tile has TILE_LANES // 16 = 256 chunks."""

SLAB_ELEMENTS = 1 << 20
"""Upper bound on the lanes of one FP32 slab temporary (4 MiB)."""

NEG_INF = float("-inf")
NAN = float("nan")


def count_rows(rows: torch.Tensor | None, total: int) -> int:
    return total if rows is None else rows.numel()


def slab_budget(n: int, valid: int, tile: int) -> int:
    """Lanes per slab: at most max(tile, min(SLAB_ELEMENTS, n * valid // 4))."""
    return max(tile, min(SLAB_ELEMENTS, n * valid // 4))


def slabs(
    n: int, valid: int, tile: int, budget: int | None = None
) -> Iterator[tuple[int, int, int, int, int]]:
    """(r0, r1, t0, t1, lanes): rows [r0, r1) x tiles [t0, t1) of `lanes` lanes each.

    Why: whole tiles of equal width let one batched op serve several tiles ([rows, tiles,
    lanes] views), as many tiles of a row as fit, then as many rows; the last, partial tile
    (valid % tile lanes) gets slabs of its own, so no lane at or beyond `valid` (padding)
    is ever read.
    """
    budget = slab_budget(n, valid, tile) if budget is None else budget
    full, rest = divmod(valid, tile)
    if full:
        per_slab = max(1, min(full, budget // tile))
        block = max(1, budget // (per_slab * tile))
        for r0 in range(0, n, block):
            for t0 in range(0, full, per_slab):
                yield r0, min(n, r0 + block), t0, min(full, t0 + per_slab), tile
    if rest:
        block = max(1, budget // rest)
        for r0 in range(0, n, block):
            yield r0, min(n, r0 + block), full, full + 1, rest


def slab_of(
    logits: torch.Tensor, rows: torch.Tensor | None, r0: int, r1: int, s: int, e: int
) -> torch.Tensor:
    """Native-dtype [r1 - r0, e - s] lanes of the flagged rows (a view when rows is None)."""
    if rows is None:
        return logits[r0:r1, s:e]
    return logits[:, s:e].index_select(0, rows[r0:r1])


class TileStats(NamedTuple):
    max: torch.Tensor
    """FP32 [n, tiles] maximum of each tile's valid lanes."""
    mass: torch.Tensor
    """FP32 [n, tiles] sum of exp(x - max) (0 for an all -inf tile)."""
    chunk_max: torch.Tensor
    """FP32 [n, full tiles, chunks]: maximum of each interleaved chunk of a whole
    tile (chunk c = lanes c, c + chunks, c + 2 * chunks, ...); reused by launch 3."""
    tail_max: torch.Tensor
    """FP32 [n, rest // 16]: the same for the first 16 * (rest // 16) lanes of the partial
    last tile (rest = valid % tile lanes); its last rest % 16 lanes have no chunk."""


def chunk_max(x: torch.Tensor) -> torch.Tensor:
    """[r, t, tile] -> [r, t, tile // CHUNK_LANES] maxima of the interleaved chunks.

    Why interleaved: reducing over a middle dimension vectorizes across the contiguous
    lanes, ten times faster on CPU than reducing 16 contiguous lanes.
    """
    r, t, lanes = x.shape
    return x.view(r, t, CHUNK_LANES, lanes // CHUNK_LANES).amax(-2)


def tile_stats(
    logits: torch.Tensor, rows: torch.Tensor | None, valid: int, tile: int = TILE_LANES
) -> TileStats:
    """Launch 1: FP32 (max, exp mass) per (flagged row, tile) over lanes [0, valid)."""
    if tile % CHUNK_LANES or tile < CHUNK_LANES:
        raise ValueError(f"tile {tile} must be a positive multiple of {CHUNK_LANES}")
    n = count_rows(rows, logits.shape[0])
    full, rest = divmod(valid, tile)
    dev = logits.device
    tmax = torch.empty(n, full + (rest > 0), dtype=torch.float32, device=dev)
    tmass = torch.empty_like(tmax)
    cmax = torch.empty(n, full, tile // CHUNK_LANES, dtype=torch.float32, device=dev)
    tail = torch.empty(n, rest // CHUNK_LANES, dtype=torch.float32, device=dev)
    scratch = torch.empty(0, dtype=torch.float32, device=dev)
    for r0, r1, t0, t1, lanes in slabs(n, valid, tile):
        x = slab_of(logits, rows, r0, r1, t0 * tile, t0 * tile + (t1 - t0) * lanes)
        x = x.view(r1 - r0, t1 - t0, lanes)
        if scratch.numel() < x.numel():
            scratch = torch.empty(x.numel(), dtype=torch.float32, device=dev)
        b = scratch[: x.numel()].view(x.shape)
        b.copy_(x)  # FP32 conversion is exact and monotone
        # 1. Tile max = max of its chunk maxima; amax propagates NaN, so a NaN lane poisons
        #    its tile's max and mass.
        if lanes == tile:
            c = chunk_max(b)
            cmax[r0:r1, t0:t1] = c
            m = c.amax(-1)
        else:
            if tail.shape[1]:
                tail[r0:r1] = chunk_max(b[..., : tail.shape[1] * CHUNK_LANES])[:, 0]
            m = b.amax(-1)
        # 2. An all -inf tile reports (-inf, 0): shift by 0 there so exp(-inf) = 0, not
        #    exp(-inf - -inf) = NaN. A +inf max keeps its shift: inf - inf = NaN mass, so the
        #    row's lse turns non-finite, as the contract requires.
        shift = torch.where(m == NEG_INF, torch.zeros_like(m), m)
        b.sub_(shift.unsqueeze(-1)).exp_()
        tmax[r0:r1, t0:t1] = m
        tmass[r0:r1, t0:t1] = b.sum(-1)
    return TileStats(tmax, tmass, cmax, tail)


def combine(tmax: torch.Tensor, tmass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, mass) parts [n, parts] -> one (M, S) per row, S relative to M."""
    big = tmax.amax(-1)
    shift = torch.where(big == NEG_INF, torch.zeros_like(big), big)
    # 3. A part with max -inf has mass 0 and weight exp(-inf) = 0: it contributes exactly 0.
    return big, (tmass * torch.exp(tmax - shift.unsqueeze(-1))).sum(-1)


def lse_from(big: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """lse = M + log(S) in FP32; any non-finite result (NaN/+inf lane, all -inf) becomes NaN."""
    lse = big + torch.log(mass)
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("nan")))


def normalization(stats: TileStats) -> torch.Tensor:
    """Launch 2: per-row normalization from the tile statistics."""
    return lse_from(*combine(stats.max, stats.mass))


def region_floor(flat: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """FP32 [n]: raw-logit floor below which no lane is among its row's best 32 keys.

    4. Split the row's chunk maxima `flat` [n, chunks] into up to 256 disjoint groups:
       the 32nd largest group maximum tau is <= the row's 32nd best raw value (32 groups,
       so 32 distinct lanes, reach it). A lane below tau still ranks if the subtraction
       ties it with tau: fl(x - lse) == fl(tau - lse) implies tau - x <= 2u(|tau| + |lse|),
       u = 2^-24 (+ 2^-149 near zero), so tau - 2^-21 (|tau| + |lse|) - 2^-140, rounded
       down to FP32, keeps all of them. Fewer than 32 chunks: -inf (every lane). A NaN lse
       (bad row) gives NaN: no lane passes, the row reports no alternatives.
    """
    n, width = flat.shape
    if width < TOP:
        tau = torch.full((n,), NEG_INF, dtype=torch.float64, device=flat.device)
    else:
        groups = min(width, 8 * TOP)
        per = width // groups
        top = flat[:, : groups * per].view(n, groups, per).amax(-1).topk(TOP, dim=-1)
        tau = top.values[:, -1].to(torch.float64)
    big = lse.to(torch.float64)
    floor = tau - (2.0**-21 * (tau.abs() + big.abs()) + 2.0**-140)
    down = floor.to(torch.float32)
    below = torch.nextafter(down, torch.full_like(down, NEG_INF))
    return torch.where(down.to(torch.float64) > floor, below, down)


def tile_candidates(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    valid: int,
    lse: torch.Tensor,
    cmax: torch.Tensor,
    tail: torch.Tensor,
    id_base: int = 0,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """Launch 3: int64 [n, tiles, 32] sort keys per tile, EMPTY_KEY-padded.

    Each tile keeps its best 32 keys among the lanes at or above the row's floor; the best
    32 of all tiles' lists are exactly the row's (or shard's) best 32. Keys rank the
    reported FP32 value float32(x) - lse, then the global id id_base + lane (ascending).
    cmax / tail: launch 1's chunk maxima of the same rows (TileStats.chunk_max, tail_max).
    """
    if valid <= tile:
        return _single_tile_candidates(logits, rows, valid, lse, id_base, tile)
    n = count_rows(rows, logits.shape[0])
    full, rest = divmod(valid, tile)
    tiles = full + (rest > 0)
    dev = logits.device
    chunks = tile // CHUNK_LANES
    flat = torch.cat((cmax.flatten(1), tail), dim=1)  # every chunk of the row, in lane order
    floor = region_floor(flat, lse)
    index = torch.arange(logits.shape[0], device=dev) if rows is None else rows
    out = torch.full((n, tiles, TOP), EMPTY_KEY, dtype=torch.int64, device=dev)
    # 5. Keep the chunks whose maximum reaches the floor (any lane >= floor lies in one).
    #    Chunk f < full * chunks is chunk f % chunks of whole tile f // chunks, lanes
    #    start + j * chunks; later ones are tail chunks, lanes start + j * tail chunks.
    r, f = (flat >= floor.unsqueeze(1)).nonzero(as_tuple=True)
    in_tail = f >= full * chunks
    t = torch.where(in_tail, full, f // chunks)
    start = t * tile + torch.where(in_tail, f - full * chunks, f % chunks)
    stride = torch.where(in_tail, tail.shape[1], chunks)
    step = max(1, slab_budget(n, valid, tile) // (4 * CHUNK_LANES))
    _chunk_candidates(out, logits, index, (r, t, start, stride), floor, lse, id_base, step)
    body = tail.shape[1] * CHUNK_LANES
    if rest > body:
        # 6. The last rest % 16 lanes (no chunk): lane by lane, never the padding beyond.
        x = slab_of(logits, rows, 0, n, full * tile + body, valid).to(torch.float32)
        r, lane = (x >= floor.unsqueeze(1)).nonzero(as_tuple=True)
        ids = id_base + full * tile + body + lane
        _scatter_best(out, r * tiles + full, x[r, lane] - lse[r], ids)
    return out


def _single_tile_candidates(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    valid: int,
    lse: torch.Tensor,
    id_base: int,
    tile: int,
) -> torch.Tensor:
    """Launch 3 when the row is one tile: int64 [n, 1, 32] keys, as many rows per slab as fit.

    5'. Every valid lane of the slab gets its key (reported value, then id: ties made by the
        subtraction and -0.0 == +0.0 resolve to the smaller id) and one topk keeps the best
        32. Padding is never read. A handful of ops per slab instead of the floor machinery's
        dozens, whose fixed cost dominates small vocabularies.
    """
    n = count_rows(rows, logits.shape[0])
    out = torch.full((n, 1, TOP), EMPTY_KEY, dtype=torch.int64, device=logits.device)
    take = min(TOP, valid)
    per = max(1, slab_budget(n, valid, tile) // valid)
    lane_ids = torch.arange(id_base, id_base + valid, device=logits.device)
    for r0 in range(0, n, per):
        r1 = min(n, r0 + per)
        # (out of place: for FP32 logits .to() returns the caller's own storage)
        values = slab_of(logits, rows, r0, r1, 0, valid).to(torch.float32) - lse[r0:r1, None]
        keys = make_keys(values, lane_ids)
        out[r0:r1, 0, :take] = keys.topk(take, dim=1, sorted=False).values
    return out


def _chunk_candidates(
    out: torch.Tensor,
    logits: torch.Tensor,
    index: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    floor: torch.Tensor,
    lse: torch.Tensor,
    id_base: int,
    step: int,
) -> None:
    """Keys of the lanes >= floor of the kept chunks (row, tile, first lane, lane stride),
    merged into out's (row, tile) groups, `step` chunks at a time.

    7. A gathered lane costs ~15 bytes (its storage offset, native and FP32 value, mask),
       so `step` chunks of 16 lanes (a quarter of a slab's lanes) stay within launch 1's
       FP32 memory whatever the data (rows of ties keep every chunk). A passing lane costs ~64 bytes
       of indices and keys: when more than a quarter pass, they are keyed a sixteenth of a
       batch at a time.
    """
    tiles = out.shape[1]
    spread = torch.arange(CHUNK_LANES, device=out.device)
    # (one flat index_select over the logits' storage: 3x faster than 2-D indexing on CPU)
    row_stride, lane_stride = logits.stride()
    span = (logits.shape[0] - 1) * row_stride + (logits.shape[1] - 1) * lane_stride + 1
    flat = logits.as_strided((span,), (1,))
    for s0 in range(0, kept[0].numel(), step):
        r, t, start, stride = (k[s0 : s0 + step] for k in kept)
        at = (index[r] * row_stride + start * lane_stride).unsqueeze(1)
        at = at + spread * (stride * lane_stride).unsqueeze(1)  # [m, 16] storage offsets
        raw = flat.index_select(0, at.flatten()).view(at.shape).to(torch.float32)
        del at
        passing = raw >= floor[r].unsqueeze(1)
        sub = step if int(passing.sum()) <= step * 4 else max(1, step // CHUNK_LANES)
        for u0 in range(0, r.numel(), sub):
            i, j = passing[u0 : u0 + sub].nonzero(as_tuple=True)
            i = i + u0
            rr = r[i]
            ids = id_base + start[i] + j * stride[i]
            _scatter_best(out, rr * tiles + t[i], raw[i, j] - lse[rr], ids)


def _scatter_best(
    out: torch.Tensor, group: torch.Tensor, values: torch.Tensor, ids: torch.Tensor
) -> None:
    """Merge new candidates into each group's best 32 keys, out.view(-1, 32)[group].

    8. Keys normalize -0.0 to +0.0 and rank equal values by ascending id. Entries arrive
       group-major (nonzero order), so each one's position in its group is its index minus
       the group's first index; a dense EMPTY_KEY-padded block [groups, 32 + cap] holding
       the group's current 32 keys and its new ones gives the merged best 32 with one topk
       (a group split across batches is merged, not overwritten).
    """
    if group.numel() == 0:
        return
    dev = out.device
    slots = out.view(-1, TOP)
    used, counts = torch.unique_consecutive(group, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.repeat_interleave(torch.arange(used.numel(), device=dev), counts)
    pos = torch.arange(group.numel(), device=dev) - first[slot]
    dense = torch.full((used.numel(), TOP + int(counts.max())), EMPTY_KEY, device=dev)
    dense[:, :TOP] = slots[used]
    dense[slot, TOP + pos] = make_keys(values, ids)
    slots[used] = dense.topk(TOP, dim=1, sorted=False).values


def final_merge(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    chosen: torch.Tensor,
    ids: torch.Tensor,
    counts: torch.Tensor,
    lse: torch.Tensor,
    natural: torch.Tensor,
    candidates: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """Launch 4: int32 [n, PAYLOAD_WORDS] payload of the flagged rows (in flag order).

    ``natural`` indexes the flagged rows whose K natural alternatives come from
    ``candidates`` [len(natural), tiles, 32]; rows with a count read their selected IDs.
    """
    dev = logits.device
    r = torch.arange(logits.shape[0], device=dev) if rows is None else rows
    c = pick_rows(chosen, rows).to(torch.int64)
    chosen_values = logits[r, c].to(torch.float32) - lse
    best = None if candidates is None else top_keys(candidates.flatten(1), k)
    cnt = pick_rows(counts, rows)
    picked = (cnt > 0).nonzero().flatten()
    sel = pick_rows(ids, rows)[picked].to(torch.int64)
    # 9. Selected IDs read their raw logits and subtract the same lse; caller order is
    #    kept, no natural alternatives. Slots beyond the count may hold stale ids: read id
    #    0 there instead (assemble_payload masks them).
    live = torch.arange(MAX_TOKEN_IDS, device=dev) < cnt[picked].unsqueeze(1)
    values = logits[r[picked].unsqueeze(1), torch.where(live, sel, 0)].to(torch.float32)
    values = values - lse[picked].unsqueeze(1)
    return assemble_payload(c, chosen_values, natural, best, picked, sel, cnt[picked], values)


# ----------------------------------------------------------------------------- CPU fast path
#
# The same four launches over the same slabs (slabs(), at most SLAB_ELEMENTS lanes and a
# quarter of the rows x vocabulary product per FP32 temporary), with far fewer tensor ops:
# launch 1 writes its results in place (out= targets, numpy views for the tiny per-slab
# steps), launch 3 ranks a handful of candidates per row on numpy instead of the floor
# machinery, and the payload is written through numpy views. Every FP32 value, every sum
# and every lse is the tile-by-tile path's (same ops on the same slabs), so the payload is
# bit for bit that path's; rows whose candidates cannot vouch for their best 32 (ties across
# a boundary, rows of -inf, a non-finite lse) take the tile-by-tile launch 3.

LEAN = True
"""Whether CPU tensors take this fast path (tests compare it with the tile-by-tile one)."""

CANDIDATE_CHUNKS = 2 * TOP
"""Chunks of 16 lanes whose lanes a row ranks in launch 3 (at most a quarter of the row's
chunks): 64, twice the 32 needed, so that ties at the 32nd value (common with bf16 logits)
still leave the next chunk strictly below it."""

PLAN_LANES = 1 << 22
"""Up to this many lanes per call, launch 1 takes the chunk and tile maxima straight from
the native rows (StatsPlan: fewest tensor calls); beyond, the per-slab loop reads them from
each slab's FP32 copy (native bf16 reductions are about 2x slower per lane)."""

CANDIDATE_ROWS = 32
"""Launch 3 gathers and ranks candidates this many rows at a time (numpy temporaries stay
small)."""

CANDIDATES = 2 * TOP
"""Lanes per row kept for the final ordering (and per row and slab in one-tile rows)."""

NAN32 = np.float32(NAN)


class Candidates(NamedTuple):
    """Launch 3's candidates of n rows: lanes (row-relative) and raw FP32 values, with an
    upper bound of the raw value of every lane of the row that is not among them."""

    lanes: np.ndarray
    """int64 [n, c]"""
    raw: np.ndarray
    """FP32 [n, c]"""
    bound: np.ndarray | None
    """FP32 [n, 1], or None when every lane of the row is a candidate."""


class Best(NamedTuple):
    ids: np.ndarray
    """int64 [n, m] row-relative lanes, best first (value desc, lane asc); -1 where the
    vocabulary has fewer lanes or a row with a non-finite lse has no alternatives."""
    values: np.ndarray
    """FP32 [n, m] their reported values, -0.0 read as +0.0 (as decoded from sort keys)."""
    missing: bool = False
    """Whether any id is -1."""


def uses_chunks(valid: int, tile: int) -> bool:
    """Whether launch 3 picks candidates from chunk maxima (their lanes are at most a
    quarter of the row) rather than from each slab's values during launch 1."""
    full, rest = divmod(valid, tile)
    return full * (tile // CHUNK_LANES) + rest // CHUNK_LANES >= 4 * CANDIDATE_CHUNKS


def lean_tile_stats(
    logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int, select: bool
) -> tuple[TileStats, Candidates | None]:
    """Launch 1 (tile_stats, bit for bit) on the flagged rows `rows` (numpy indices) of CPU
    logits. With `select`, rows too narrow for chunk candidates (uses_chunks) also keep
    launch 3's candidates: in every slab, each row's CANDIDATES largest raw values (ties
    broken arbitrarily), the next value bounding the rest, picked from the slab's FP32
    values before they are exponentiated.

    Consecutive rows with unit lane stride take the chunk and tile maxima straight from the
    native rows (small outputs, one op per region), then per slab only three ops: the FP32
    subtraction of the tile shifts into the slab scratch (the conversion fused in), exp,
    and the tile sums. Other rows go slab by slab as tile_stats does, with fewer ops.
    """
    if tile % CHUNK_LANES or tile < CHUNK_LANES:
        raise ValueError(f"tile {tile} must be a positive multiple of {CHUNK_LANES}")
    n = rows.size
    picks: dict[int, list] | None = {} if select and not uses_chunks(valid, tile) else None
    first = int(rows[0])
    x = None
    if int(rows[-1]) - first == n - 1:
        x = logits[first : first + n, :valid]
    if picks is None and x is not None and x.stride(-1) == 1 and n * valid <= PLAN_LANES:
        return stats_plan(n, valid, tile).run(x), None
    full, rest = divmod(valid, tile)
    tiles = full + (rest > 0)
    f32 = torch.float32
    tmax, tmass = torch.empty(n, tiles, dtype=f32), torch.empty(n, tiles, dtype=f32)
    shift = torch.empty(n, tiles, 1, dtype=f32)
    cmax = torch.empty(n, full, tile // CHUNK_LANES, dtype=f32)
    tail = torch.empty(n, rest // CHUNK_LANES, dtype=f32)
    stats = TileStats(tmax, tmass, cmax, tail)
    budget = slab_budget(n, valid, tile)
    scratch = torch.empty(min(budget, n * valid), dtype=f32)
    np_tmax, np_cmax, np_shift = tmax.numpy(), cmax.numpy(), shift.numpy()[..., 0]
    body = tail.shape[1] * CHUNK_LANES
    for r0, r1, t0, t1, lanes in slabs(n, valid, tile, budget):
        s, e = t0 * tile, t0 * tile + (t1 - t0) * lanes
        if x is not None:
            xs = x[r0:r1, s:e]
        else:
            xs = logits[:, s:e].index_select(0, torch.from_numpy(rows[r0:r1]))
        b = scratch[: xs.numel()].view(r1 - r0, t1 - t0, lanes)
        b.copy_(xs.view(b.shape))  # FP32 conversion is exact and monotone
        # 1. Tile max = max of its chunk maxima (NaN propagates: a NaN lane poisons its
        #    tile's max and mass).
        if lanes == tile:
            torch.amax(b.view(r1 - r0, t1 - t0, CHUNK_LANES, lanes // CHUNK_LANES), 2,
                       out=cmax[r0:r1, t0:t1])
            np.max(np_cmax[r0:r1, t0:t1], axis=-1, out=np_tmax[r0:r1, t0:t1])
        else:
            if body:
                torch.amax(b[..., :body].view(r1 - r0, CHUNK_LANES, body // CHUNK_LANES), 1,
                           out=tail[r0:r1])
            torch.amax(b, -1, out=tmax[r0:r1, t0:t1])
        if picks is not None:
            _pick_raw(b.numpy().reshape(r1 - r0, e - s), s, picks.setdefault(s, []), r0)
        # 2. An all -inf tile shifts by 0 (so exp(-inf) = 0, not NaN); +inf and NaN maxima
        #    keep their shift, turning the row's lse non-finite, as the contract requires.
        view = np_shift[r0:r1, t0:t1]
        np.copyto(view, np_tmax[r0:r1, t0:t1])
        np.copyto(view, np.float32(0.0), where=view == NEG_INF)
        b.sub_(shift[r0:r1, t0:t1]).exp_()
        torch.sum(b, -1, out=tmass[r0:r1, t0:t1])
    return stats, _gather_picks(picks, n)


class StatsPlan:
    """Launch 1's buffers and slab views for n consecutive rows of `valid` lanes, kept per
    thread between calls (`stats_plan`): each call then costs five tensor calls per slab
    (a slice of the rows, the FP32 copy into the slab scratch, the shift subtraction, exp,
    the tile sums into place) plus a few for the chunk and tile maxima, which come straight
    from the native rows (small outputs). The slabs are slabs()'s: the largest FP32
    temporary is one slab. Only logits with unit lane stride take it."""

    def __init__(self, n: int, valid: int, tile: int) -> None:
        full, rest = divmod(valid, tile)
        tiles, per = full + (rest > 0), tile // CHUNK_LANES
        f32 = torch.float32
        self.n, self.valid, self.tile, self.full = n, valid, tile, full
        self.flat = torch.empty(n, full * per + rest // CHUNK_LANES, dtype=f32)
        """Every chunk maximum of a row, in TileStats order (whole tiles', then the tail's)."""
        cmax = self.flat[:, : full * per].view(n, full, per)
        tail = self.flat[:, full * per :]
        self.stats = TileStats(torch.empty(n, tiles, dtype=f32), torch.empty(n, tiles, dtype=f32),
                               cmax, tail)
        self.shift = torch.empty(n, tiles, 1, dtype=f32)
        self.np_max, self.np_cmax = self.stats.max.numpy(), cmax.numpy()
        self.np_shift = self.shift.numpy()[..., 0]
        self.body = tail.shape[1] * CHUNK_LANES
        budget = slab_budget(n, valid, tile)
        scratch = torch.empty(min(budget, n * valid), dtype=f32)
        self.steps = []
        for r0, r1, t0, t1, lanes in slabs(n, valid, tile, budget):
            shape = (r1 - r0, t1 - t0, lanes)
            b = scratch[: shape[0] * shape[1] * lanes].view(shape)
            region = (slice(r0, r1), slice(t0, t1)) if lanes == tile else slice(r0, r1)
            self.steps.append((lanes == tile, region, b, self.shift[r0:r1, t0:t1],
                               self.stats.mass[r0:r1, t0:t1]))
        self.nbytes = sum(t.numel() * 4 for t in (self.flat, self.stats.max, self.stats.mass,
                                                  self.shift, scratch))

    def run(self, x: torch.Tensor) -> TileStats:
        """Launch 1 on x [n, valid] (native dtype, unit lane stride): tile_stats bit for bit
        (the same FP32 values, shifts and per-tile sums; a sum over a tile's lanes does not
        depend on which other tiles share its slab)."""
        n, tile, full = self.n, self.tile, self.full
        tmax, cmax, tail = self.stats.max, self.stats.chunk_max, self.stats.tail_max
        whole = x[:, : full * tile].view(n, full, tile) if full else None
        if full:
            cmax.copy_(whole.view(n, full, CHUNK_LANES, tile // CHUNK_LANES).amax(2))
            np.max(self.np_cmax, axis=-1, out=self.np_max[:, :full])
        part = None
        if full < tmax.shape[1]:
            part = x[:, full * tile :]
            if self.body:
                chunks = part[:, : self.body].view(n, CHUNK_LANES, self.body // CHUNK_LANES)
                tail.copy_(chunks.amax(1))
            tmax[:, full:] = part.amax(-1, keepdim=True)
            part = part.unsqueeze(1)
        # 2. An all -inf tile shifts by 0 (so exp(-inf) = 0, not NaN); +inf and NaN maxima
        #    keep their shift, turning the row's lse non-finite, as the contract requires.
        np.copyto(self.np_shift, self.np_max)
        np.copyto(self.np_shift, np.float32(0.0), where=self.np_shift == NEG_INF)
        for in_tiles, region, b, shift, mass in self.steps:
            b.copy_(whole[region] if in_tiles else part[region])  # exact FP32 conversion
            b.sub_(shift).exp_()
            torch.sum(b, -1, out=mass)
        return self.stats


class _Plans(threading.local):
    def __init__(self) -> None:
        self.plans: OrderedDict[tuple[int, int, int], StatsPlan] = OrderedDict()


_PLANS = _Plans()
PLANS_KEPT = 4
"""StatsPlans kept per thread (each at most one slab of FP32 scratch plus per-row stats)."""


def stats_plan(n: int, valid: int, tile: int) -> StatsPlan:
    key = (n, valid, tile)
    plans = _PLANS.plans
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = StatsPlan(n, valid, tile)
        while len(plans) > PLANS_KEPT:
            plans.popitem(last=False)
    else:
        plans.move_to_end(key)
    return plan


def native_values(logits: torch.Tensor, rows: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    """FP32 [n, j] logits[rows[i], lanes[i, j]] of CPU logits, read through numpy (bf16 bits
    widened exactly: a bf16 value is the upper half of its FP32 value)."""
    if logits.dtype == torch.bfloat16:
        bits = logits.view(torch.int16).numpy()[rows[:, None], lanes]
        return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return logits.numpy()[rows[:, None], lanes].astype(np.float32)


def _pick_raw(raw: np.ndarray, start: int, into: list, r0: int) -> None:
    """The largest CANDIDATES raw values of each row of a slab segment [r, lanes] starting
    at lane `start`, and the next value (None when every lane is kept)."""
    r, width = raw.shape
    if width <= CANDIDATES:
        into.append((r0, np.broadcast_to(np.arange(start, start + width), (r, width)),
                     raw.copy(), None))
        return
    part = np.argpartition(raw, width - CANDIDATES - 1, axis=1)
    keep = part[:, width - CANDIDATES :]
    rix = np.arange(r)[:, None]
    into.append((r0, keep + start, raw[rix, keep],
                 raw[rix, part[:, width - CANDIDATES - 1 : width - CANDIDATES]]))


def _gather_picks(picks: dict[int, list] | None, n: int) -> Candidates | None:
    """Each segment's picks, row blocks stacked, segments side by side."""
    if picks is None:
        return None
    lanes, raw, bounds = [], [], []
    for parts in picks.values():
        parts.sort(key=lambda p: p[0])
        lanes.append(np.concatenate([p[1] for p in parts]))
        raw.append(np.concatenate([p[2] for p in parts]))
        if parts[0][3] is not None:
            bounds.append(np.concatenate([p[3] for p in parts]))
    bound = None
    if bounds:
        bound = bounds[0] if len(bounds) == 1 else np.max(np.stack(bounds), axis=0)
    return Candidates(np.concatenate(lanes, axis=1), np.concatenate(raw, axis=1), bound)


def lean_combine(stats: TileStats) -> tuple[np.ndarray, torch.Tensor]:
    """(M numpy [n], S torch [n]) FP32, bit-identical to combine(stats.max, stats.mass)
    (NaN bits aside: a NaN there always ends as lse_from's canonical NaN)."""
    tmax, tmass = stats.max, stats.mass
    if tmax.shape[1] == 1:
        # One tile: combine's weight is exp(0) = 1 (or its product is 0 or NaN exactly when
        # the mass already is), so (M, S) = (max, mass).
        return tmax.numpy()[:, 0], tmass[:, 0]
    big = tmax.numpy().max(axis=1)
    shift = np.where(big == NEG_INF, np.float32(0.0), big)
    # (tmax - shift in torch: inf - inf is NaN there too, without a numpy warning)
    weights = torch.sub(tmax, torch.from_numpy(shift[:, None])).exp_()
    return big, weights.mul_(tmass).sum(-1)


def lean_lse(stats: TileStats) -> tuple[np.ndarray, bool]:
    """Launch 2: (FP32 lse [n] numpy, all finite), bit-identical to normalization(stats)."""
    big, mass = lean_combine(stats)
    lse = torch.log(mass).numpy()
    np.add(lse, big, out=lse)  # fl(log S + M) == fl(M + log S)
    finite = np.isfinite(lse)
    ok = bool(finite.all())
    if not ok:
        lse[~finite] = NAN32
    return lse, ok


def kept_bytes() -> int:
    """Bytes of launch-1 scratch this thread keeps between calls (StatsPlans)."""
    return sum(plan.nbytes for plan in _PLANS.plans.values())


def release_plans() -> None:
    """Drop this thread's kept StatsPlans."""
    _PLANS.plans.clear()


_LAYOUTS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _chunk_layout(valid: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(first lane, lane stride) of every chunk of a row, in TileStats order: the whole
    tiles' interleaved chunks, then the partial tile's (its last valid % 16 lanes belong to
    no chunk)."""
    key = (valid, tile)
    hit = _LAYOUTS.get(key)
    if hit is None:
        full, rest = divmod(valid, tile)
        per = tile // CHUNK_LANES
        f = np.arange(full * per)
        base = [(f // per) * tile + f % per]
        stride = [np.full(f.size, per)]
        tail = rest // CHUNK_LANES
        if tail:
            base.append(full * tile + np.arange(tail))
            stride.append(np.full(tail, tail))
        hit = _LAYOUTS[key] = (np.concatenate(base), np.concatenate(stride))
    return hit


def chunk_candidates(
    logits: torch.Tensor, rows: np.ndarray, valid: int, tile: int, cmax: np.ndarray,
    tail: np.ndarray, extra: np.ndarray | None = None,
) -> tuple[Candidates, np.ndarray | None]:
    """Launch 3's candidates for rows with enough chunks (uses_chunks): the lanes of each
    row's CANDIDATE_CHUNKS highest chunks plus the partial tile's chunkless last lanes,
    their raw values read from the native logits (a quarter of the row at most), and the
    next chunk's maximum as the bound of every other lane. `extra` [n, j]: more lanes per row to
    read in the same gather (returned raw, FP32)."""
    n = rows.size
    flat = np.concatenate((cmax.reshape(n, -1), tail), axis=1) if tail.shape[1] else \
        cmax.reshape(n, -1)
    count = flat.shape[1]
    base, stride = _chunk_layout(valid, tile)
    cut = count - CANDIDATE_CHUNKS - 1
    part = np.argpartition(flat, cut, axis=1)
    chosen = part[:, cut + 1 :]
    lanes = (base[chosen][..., None] + stride[chosen][..., None] * np.arange(CHUNK_LANES))
    lanes = lanes.reshape(n, -1)
    loose = valid - (valid // tile) * tile - tail.shape[1] * CHUNK_LANES
    if loose:
        lanes = np.concatenate((lanes, np.broadcast_to(np.arange(valid - loose, valid),
                                                       (n, loose))), axis=1)
    bound = np.take_along_axis(flat, part[:, cut : cut + 1], 1)
    width = lanes.shape[1]
    if extra is not None:
        lanes = np.concatenate((lanes, extra), axis=1)
    raw = native_values(logits, rows, lanes)
    more = None if extra is None else raw[:, width:]
    return Candidates(lanes[:, :width], raw[:, :width], bound), more


def rank_candidates(cand: Candidates, lse: np.ndarray, take: int) -> tuple[Best, np.ndarray]:
    """Launch 3's ordering: (each row's best min(take, 32, candidates) lanes, bool [n]
    whether that is provably the row's exact best).

    5'. Reported value v = fl(x - lse), monotone in x. Every lane that is not a candidate
        has raw value <= bound, so v <= fl(bound - lse). The best 64 candidates by value
        contain every candidate valued at least the take-th best when the 65th is below
        it. When both bounds are below the take-th best value, ordering those 64 by
        (value desc, lane asc), -0.0 equal to +0.0, is exactly the sort keys' order of the
        row's best `take`. Otherwise (ties across a boundary, rows of -inf) and for a NaN
        lse the row is not exact and must be recomputed.
    """
    lanes, lse2 = cand.lanes, lse[:, None]
    values = cand.raw - lse2
    bound = None if cand.bound is None else cand.bound - lse2
    n, width = values.shape
    m = min(take, TOP, width)
    rix = np.arange(n)[:, None]
    if width > CANDIDATES:
        part = np.argpartition(values, width - CANDIDATES - 1, axis=1)
        inner = values[rix, part[:, width - CANDIDATES - 1 : width - CANDIDATES]]
        keep = part[:, width - CANDIDATES :]
        lanes, values = lanes[rix, keep], values[rix, keep]
        bound = inner if bound is None else np.maximum(bound, inner)
    order = np.lexsort((lanes, -values), axis=1)[:, :m]
    values = values[rix, order] + np.float32(0.0)
    ids = lanes[rix, order]
    exact = np.isfinite(lse) if bound is None else bound[:, 0] < values[:, m - 1]
    return Best(ids, values), exact


def exact_best(
    logits: torch.Tensor, rows: np.ndarray, valid: int, lse: np.ndarray, take: int,
    stats: TileStats, which: np.ndarray, tile: int = TILE_LANES,
) -> Best:
    """The tile-by-tile launch 3 (tile_candidates) for rows `which` (indices into `rows`
    and the stats): ids (row-relative, -1 where none) and values of their best `take`."""
    index = torch.from_numpy(which)
    keys = tile_candidates(logits, torch.from_numpy(rows[which]), valid,
                           torch.from_numpy(lse[which]), stats.chunk_max[index],
                           stats.tail_max[index], 0, tile)
    best = top_keys(keys.flatten(1), take)
    empty = (best == EMPTY_KEY).numpy()
    ids = np.where(empty, -1, key_ids(best).numpy())
    return Best(ids, np.where(empty, NAN32, key_values(best).numpy()), bool(empty.any()))


def natural_best(
    logits: torch.Tensor, rows: np.ndarray, valid: int, stats: TileStats,
    picks: Candidates | None, lse: np.ndarray, take: int, tile: int = TILE_LANES,
    extra: np.ndarray | None = None,
) -> tuple[Best, np.ndarray | None]:
    """The exact best `take` lanes of each of `rows` (launch 3), and `extra` lanes' raw
    values when candidates are gathered (else None)."""
    more = None
    if picks is None:
        if not uses_chunks(valid, tile):  # (lean_tile_stats picks these rows' candidates)
            raise ValueError("rows this narrow need the candidates lean_tile_stats picks")
        cmax, tail = stats.chunk_max.numpy(), stats.tail_max.numpy()
        if rows.size > CANDIDATE_ROWS:
            parts = [natural_best(logits, rows[r0 : r0 + CANDIDATE_ROWS], valid,
                                  _rows_of(stats, r0, CANDIDATE_ROWS), None,
                                  lse[r0 : r0 + CANDIDATE_ROWS], take, tile,
                                  None if extra is None else extra[r0 : r0 + CANDIDATE_ROWS])
                     for r0 in range(0, rows.size, CANDIDATE_ROWS)]
            best = Best(np.concatenate([p[0].ids for p in parts]),
                        np.concatenate([p[0].values for p in parts]),
                        any(p[0].missing for p in parts))
            if extra is not None:
                more = np.concatenate([p[1] for p in parts])
            return best, more
        picks, more = chunk_candidates(logits, rows, valid, tile, cmax, tail, extra)
    best, exact = rank_candidates(picks, lse, take)
    if exact.all():
        return best, more
    redo = np.flatnonzero(~exact)
    again = exact_best(logits, rows, valid, lse, best.ids.shape[1], stats, redo, tile)
    ids, values = best.ids.copy(), best.values.copy()
    ids[redo], values[redo] = again.ids, again.values
    return Best(ids, values, again.missing), more


def _rows_of(stats: TileStats, r0: int, count: int) -> TileStats:
    """Rows [r0, r0 + count) of launch 1's statistics (views)."""
    return TileStats(*(t[r0 : r0 + count] for t in stats))


class NumpyRequest:
    """A RowRequest's tensors as numpy views (CPU), taken when first used."""

    def __init__(self, request: RowRequest) -> None:
        self.request = request
        self.k = request.k
        self.requested = request.requested.numpy()
        self.counts = request.counts.numpy()
        self.chosen = request.chosen.numpy()

    @property
    def ids(self) -> np.ndarray:
        return self.request.ids.numpy()


def _subtract(raw: np.ndarray, lse: np.ndarray, finite: bool) -> np.ndarray:
    """FP32 raw - lse [n, j] as torch computes it: fma(lse, -1, x) returns lse's (canonical)
    NaN when both are NaN, so rows with a NaN lse report exactly that NaN."""
    values = raw - lse[:, None]
    if not finite:
        values[np.isnan(lse)] = NAN32
    return values


def _reduce_lean(logits: torch.Tensor, request: RowRequest, vocab_size: int,
                 out: torch.Tensor, tile: int) -> torch.Tensor:
    """reduce_torch on CPU: the same slabs and launches, lean (see the section comment)."""
    req = NumpyRequest(request)
    rows = np.flatnonzero(req.requested)
    n = rows.size
    if n == 0:
        return out
    k = req.k
    counts = req.counts[rows]
    any_selected = bool(counts.any())
    natural = np.flatnonzero(counts == 0) if any_selected else None
    want = bool(k) and (natural is None or natural.size > 0)
    stats, picks = lean_tile_stats(logits, rows, vocab_size, tile, select=want)
    lse, finite = lean_lse(stats)
    chosen = req.chosen[rows].astype(np.int64)
    payload = np.empty((n, PAYLOAD_WORDS), np.int32)
    payload[:, CHOSEN_ID] = chosen
    pairs = payload[:, FIRST_PAIR:].reshape(n, MAX_TOKEN_IDS, 2)
    pairs[:] = -1
    chosen_raw = None
    if want:
        nat = rows if natural is None else rows[natural]
        if natural is not None:
            picks = None if picks is None else Candidates(
                picks.lanes[natural], picks.raw[natural],
                None if picks.bound is None else picks.bound[natural])
            sub = TileStats(stats.max, stats.mass, stats.chunk_max[torch.from_numpy(natural)],
                            stats.tail_max[torch.from_numpy(natural)])
        else:
            sub = stats
        extra = chosen[:, None] if natural is None and picks is None else None
        best, chosen_raw = natural_best(logits, nat, vocab_size, sub, picks,
                                        lse if natural is None else lse[natural], k, tile,
                                        extra)
        m = best.ids.shape[1]
        bits = best.values.view(np.int32)
        if best.missing:
            bits = np.where(best.ids < 0, np.int32(-1), bits)
        target = pairs if natural is None else pairs[natural]
        target[:, :m, 0] = best.ids
        target[:, :m, 1] = bits
        if natural is not None:
            pairs[natural] = target
    if chosen_raw is None:
        chosen_raw = native_values(logits, rows, chosen[:, None])
    payload[:, CHOSEN_BITS] = _subtract(chosen_raw, lse, finite).view(np.int32)[:, 0]
    if any_selected:
        picked = np.flatnonzero(counts > 0)
        if picked.size:
            sel = req.ids[rows[picked]].astype(np.int64)
            # 9. (final_merge) selected IDs read their raw logits minus the same lse, caller
            #    order; slots beyond the count may hold stale ids and read lane 0 instead.
            live = np.arange(MAX_TOKEN_IDS) < counts[picked, None]
            raw = native_values(logits, rows[picked], np.where(live, sel, 0))
            values = _subtract(raw, lse[picked], finite)
            pairs[picked, :, 0] = np.where(live, sel, -1)
            pairs[picked, :, 1] = np.where(live, values.view(np.int32), -1)
    out_np = out.numpy()
    if n == out_np.shape[0]:
        out_np[:] = payload
    else:
        out_np[rows] = payload
    return out


def reduce_torch(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    *,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """The four launches on the flagged rows of a full-vocabulary [rows, width] block."""
    if LEAN and logits.device.type == "cpu":
        return _reduce_lean(logits, request, vocab_size, out, tile)
    chosen, ids, counts, k = request.chosen, request.ids, request.counts, request.k
    rows = flagged_rows(request.requested != 0)
    n = count_rows(rows, logits.shape[0])
    if n == 0:
        return out
    stats = tile_stats(logits, rows, vocab_size, tile)
    lse = normalization(stats)
    natural = (pick_rows(counts, rows) == 0).nonzero().flatten()
    candidates = None
    if k > 0 and natural.numel():
        sub = natural if rows is None else rows[natural]
        if natural.numel() == logits.shape[0]:
            sub = None
        cmax, tail = stats.chunk_max, stats.tail_max
        if natural.numel() < n:
            cmax, tail = cmax[natural], tail[natural]
        candidates = tile_candidates(logits, sub, vocab_size, lse[natural], cmax, tail, 0, tile)
    payload = final_merge(logits, rows, chosen, ids, counts, lse, natural, candidates, k)
    write_rows(out, rows, payload)
    return out
