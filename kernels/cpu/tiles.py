"""The contract's four launches as plain torch functions, tile by tile (any device).

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
The sharded steps (kernels/cpu/sharded.py) reuse launches 1 and 3 on their shard; CPU
tensors take the same launches with fewer tensor calls (kernels/cpu/lean.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS
from helios_logprobs.kernels.layout import TILE_CANDIDATES as TOP
from helios_logprobs.kernels.payload import assemble_payload, pick_rows, top_keys
from helios_logprobs.kernels.sortkeys import EMPTY_KEY, make_keys

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
