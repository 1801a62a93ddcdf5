"""CPU production path: the contract's four launches as plain torch functions.

1. ``tile_stats``     vocabulary tiles -> FP32 max and exp mass per (row, tile).
2. ``normalization``  small reduction -> per-row lse = M + log(S).
3. ``tile_candidates`` each tile's best 32 sort keys of the reported FP32 values (x - lse),
                      among the lanes that can still reach the row's best 32.
4. ``final_merge``    best K of the candidate keys + the chosen pair, or the selected IDs' raw
                      logits minus the same lse.

Two ways to run them, with bit-identical results (same FP32 tile maxima and masses, same
summation order per tile, same lse; the alternatives are the exact best K keys either way):

- Whole-row blocks (``reduce_torch`` whenever a row fits ``ROW_LANES`` or the slab budget):
  a block of rows is converted once into a reused FP32 scratch whose tiles are padded with
  -inf, and every launch reads that scratch: one pass of chunk maxima gives the tile maxima
  and the candidate chunks, one subtraction and one exp over the block give every tile's
  mass. The best 32 of each row come from its 32 highest chunks (32 x 16 lanes), which is
  provably exact when the 33rd chunk's reported maximum is below the 32nd candidate; rows
  where it is not (ties across the boundary, rows of -inf) and rows with a non-finite lse
  take the tile-by-tile launch 3 below. About 40 tensor ops per block instead of ~15 per
  tile: the fixed cost that dominated one-row calls.
- Slab by slab (rows wider than a block allows): logits are read one slab at a time (whole
  tiles of a block of rows, at most ``SLAB_ELEMENTS`` lanes and at most a quarter of the rows
  x vocabulary product). Launch 3 converts only the few chunks that reach a floor derived
  from launch 1's chunk maxima.

Memory: the largest FP32 temporary is one slab or one block (two FP32 copies of at most
``max(one row, a quarter of the rows x vocabulary product, SLAB_ELEMENTS lanes)``, one row only
up to ``ROW_LANES``); no [rows, vocabulary] FP32 copy ever exists for more than one row. Only
flagged rows are read: a row subset is index-selected per slab or block, never as whole rows.
The sharded steps (kernels/torch_sharded.py) reuse both on their shard.
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

CANDIDATE_CHUNKS = 2 * TOP
"""Chunks whose lanes a whole-row block ranks: the row's highest 64 (1,024 lanes), twice
the 32 needed, so that ties at the 32nd value (common with bf16 logits, 8-bit mantissas)
still leave the 65th chunk strictly below it."""

SMALL_BLOCK_LANES = 1 << 16
"""A block may always hold this many lanes (256 KiB of FP32), however small the rows x
vocabulary product: decode's [capacity, 1,031] logits are one block."""

ROW_LANES = 1 << 18
"""Widest (padded) row that a whole-row block takes alone (1 MiB of FP32) even when it is
more than a quarter of the rows x vocabulary product; wider rows go slab by slab."""

SCRATCH_BYTES = 1 << 25
"""Scratch that whole-row blocks keep between calls, per thread (LRU by exact shape)."""

NEG_INF = float("-inf")
POS_INF = float("inf")
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


# ----------------------------------------------------------------------------- whole-row blocks


class Geometry(NamedTuple):
    """How a whole-row block lays out `valid` lanes: `tiles` tiles of `width` lanes (the
    contract's tiles; a row narrower than one tile is one tile of `valid` lanes rounded up
    to a chunk), padded with -inf up to tiles * width."""

    valid: int
    width: int
    tiles: int
    full: int
    """Tiles made only of real lanes (the last one is partial when full < tiles)."""

    @property
    def padded(self) -> int:
        return self.tiles * self.width

    @property
    def chunks(self) -> int:
        """Interleaved chunks of 16 lanes per tile: chunk c of tile t is lanes
        t * width + c + j * chunks, j < 16 (the chunks of tile_stats, on padded tiles)."""
        return self.width // CHUNK_LANES


def geometry(valid: int, tile: int) -> Geometry:
    if tile % CHUNK_LANES or tile < CHUNK_LANES:
        raise ValueError(f"tile {tile} must be a positive multiple of {CHUNK_LANES}")
    if valid <= tile:
        width = -(-valid // CHUNK_LANES) * CHUNK_LANES
        return Geometry(valid, width, 1, int(valid == width))
    return Geometry(valid, tile, -(-valid // tile), valid // tile)


def block_rows(n: int, valid: int, tile: int, device: torch.device) -> int:
    """Rows per whole-row block: as many padded rows as the slab budget (or
    SMALL_BLOCK_LANES) holds, at least one row up to ROW_LANES lanes; 0 when rows are too
    wide or not on the CPU (then slab by slab)."""
    if device.type != "cpu":
        return 0
    padded = geometry(valid, tile).padded
    per = max(slab_budget(n, valid, tile), SMALL_BLOCK_LANES) // padded
    if per == 0 and padded <= ROW_LANES:
        per = 1
    return min(per, n)


class Best(NamedTuple):
    ids: np.ndarray
    """int64 [b, m] ids, best first (value desc, id asc); -1 where the vocabulary has fewer
    ids or a row with a non-finite lse has no alternatives."""
    values: np.ndarray
    """FP32 [b, m] their reported values, -0.0 read as +0.0."""
    missing: bool = False
    """Whether any id is -1."""


class RowBlock:
    """Prepared CPU buffers for blocks of `rows` whole rows of one geometry, kept between
    calls per thread (`row_block`). Bulk passes are torch ops (bit-identical to tile_stats);
    the small bookkeeping runs on numpy views of the same memory, whose per-call cost is a
    fraction of a torch op's. Launches on a loaded block:

    stats          launch 1: one pass of chunk maxima gives the tile maxima (and, with
                   `select`, each row's candidate lanes and their raw values for launch 3);
                   then one subtraction of each tile's shift and one exp, in place, and each
                   tile's sum give the masses. Same FP32 values and the same sums over the
                   same lanes as tile_stats (exp is elementwise, and a sum over a row's last
                   dimension does not depend on its neighbours): bit for bit its max and mass.
    normalization  launch 2, bit-identical to lse_from(*combine(max, mass)).
    best           launch 3 on the selected candidates: each row's exact best <= 32 lanes,
                   or a mark to recompute it.
    """

    def __init__(self, rows: int, geo: Geometry) -> None:
        b, f32 = rows, torch.float32
        self.rows, self.geo = rows, geo
        self.raw = torch.full((b, geo.padded), NEG_INF, dtype=f32)
        """FP32 [b, padded]: the block's logits, -inf beyond `valid`; stats() turns the valid
        lanes into exp(x - tile max) in place."""
        self.raw_valid = self.raw[:, : geo.valid]
        self.raw_padding = self.raw[:, geo.valid :]
        self.cmax = torch.empty(b, geo.tiles, geo.chunks, dtype=f32)
        self.max = torch.empty(b, geo.tiles, dtype=f32)
        self.shift = torch.empty(b, geo.tiles, 1, dtype=f32)
        self.mass = torch.empty(b, geo.tiles, dtype=f32)
        self.weights = torch.empty(b, geo.tiles, dtype=f32)
        self.total = torch.empty(b, 1, dtype=f32)
        self.lse = torch.empty(b, 1, dtype=f32)
        body = geo.full * geo.width
        self.raw4 = self.raw.view(b, geo.tiles, CHUNK_LANES, geo.chunks)
        self.raw3 = self.raw.view(b, geo.tiles, geo.width)
        self.sums = []
        if geo.full:
            self.sums.append((self.raw[:, :body].view(b, geo.full, geo.width),
                              self.mass[:, : geo.full], False))
        if geo.full < geo.tiles:
            self.sums.append((self.raw[:, body : geo.valid], self.mass[:, geo.full :], True))
        self.np_raw = self.raw.numpy()
        self.np_cmax3 = self.cmax.numpy()
        self.np_cmax = self.np_cmax3.reshape(b, geo.tiles * geo.chunks)
        self.np_max = self.max.numpy()
        self.np_shift = self.shift.numpy()[..., 0]
        self.np_mass = self.mass.numpy()
        self.np_weights = self.weights.numpy()
        self.np_lse = self.lse.numpy()
        self.row_index = np.arange(b)[:, None]
        count = geo.tiles * geo.chunks
        self.all_lanes = count <= CANDIDATE_CHUNKS
        if self.all_lanes:
            self.lane_ids = np.broadcast_to(np.arange(geo.valid), (b, geo.valid))
        else:
            f = np.arange(count)
            self.chunk_base = f + (f // geo.chunks) * (geo.width - geo.chunks)
            self.spread = np.arange(CHUNK_LANES) * geo.chunks
        self.nbytes = sum(t.numel() * t.element_size() for t in
                          (self.raw, self.cmax, self.max, self.shift, self.mass,
                           self.weights, self.total, self.lse))
        self.owner: tuple | None = None
        """What the selected candidates belong to (kernels/torch_sharded.py reuses them)."""
        self.finite = True
        """Whether every row's lse was finite at the last normalization."""
        self.candidates: tuple[np.ndarray | None, np.ndarray, np.ndarray | None] | None = None
        """(lanes int64 [rows, c] or None for every lane, their raw FP32 values [rows, c],
        the raw bound of every other lane [rows, 1] or None), from select()."""

    def load(self, x: torch.Tensor) -> None:
        """x: [rows, valid] of any float dtype and strides (the exact FP32 conversion)."""
        self.raw_valid.copy_(x)
        self.owner = self.candidates = None

    def chunk_pass(self) -> None:
        """Only the chunk maxima of launch 1 (what select needs)."""
        torch.amax(self.raw4, 2, out=self.cmax)

    def select(self) -> None:
        """Launch 3's candidates, from the loaded raw values and the chunk maxima.

        5'. Candidates are the lanes of the row's CANDIDATE_CHUNKS highest chunks (all lanes
            when it has no more chunks). Every other lane lies in a chunk whose maximum is at
            most the next chunk maximum tau, so its reported value is at most fl(tau - lse).
        """
        raw = self.np_raw
        if self.all_lanes:
            self.candidates = (None, raw[:, : self.geo.valid].copy(), None)
            return
        cmax = self.np_cmax
        count = cmax.shape[1]
        cut = count - CANDIDATE_CHUNKS - 1
        if self.rows == 1:
            part = np.argpartition(cmax[0], cut)
            lanes = np.add.outer(self.chunk_base[part[cut + 1 :]], self.spread).reshape(1, -1)
            self.candidates = (lanes, raw[0, lanes[0]][None], cmax[:, part[cut : cut + 1]])
            return
        rix = self.row_index
        part = np.argpartition(cmax, cut, axis=1)
        first = self.chunk_base[part[:, cut + 1 :]]
        lanes = (first[:, :, None] + self.spread).reshape(self.rows, -1)
        self.candidates = (lanes, raw[rix, lanes], cmax[rix, part[:, cut : cut + 1]])

    def stats(self, select: bool = False) -> None:
        """Launch 1 -> cmax, max, mass (and the candidates with `select`). The raw values
        are gone afterwards."""
        torch.amax(self.raw4, 2, out=self.cmax)
        np.max(self.np_cmax3, axis=-1, out=self.np_max)
        if select:
            self.select()
        # 2. as tile_stats: an all -inf tile shifts by 0; +inf and NaN maxima keep theirs.
        np.copyto(self.np_shift, self.np_max)
        np.copyto(self.np_shift, np.float32(0.0), where=self.np_max == NEG_INF)
        torch.sub(self.raw3, self.shift, out=self.raw3)
        if np.isnan(self.np_shift).any():
            self.raw_padding.fill_(NEG_INF)  # -inf - NaN: padding must stay -inf
        self.raw_valid.exp_()  # padding lanes are never summed, so never exponentiated
        for lanes, mass, keepdim in self.sums:
            torch.sum(lanes, -1, keepdim=keepdim, out=mass)

    def combine(self) -> tuple[np.ndarray, torch.Tensor]:
        """(M numpy, S torch) FP32 [rows, 1]: bit-identical to combine(max, mass) (NaN bits
        aside: a NaN there always ends as the canonical NaN of lse_from)."""
        if self.geo.tiles == 1:
            # One tile: combine's weight is exp(0) = 1 (or its product is 0 or NaN exactly
            # when the mass already is), so (M, S) = (max, mass).
            return self.np_max, self.mass
        big = self.np_max.max(axis=1, keepdims=True)
        shift = np.where(big == NEG_INF, np.float32(0.0), big)
        # (tmax - shift in torch: inf - inf is NaN there too, without a numpy warning)
        torch.sub(self.max, torch.from_numpy(shift), out=self.weights).exp_()
        np.multiply(self.np_weights, self.np_mass, out=self.np_weights)
        return big, torch.sum(self.weights, -1, keepdim=True, out=self.total)

    def normalization(self) -> np.ndarray:
        """Launch 2 -> lse FP32 [rows, 1] (a numpy view of self.lse), bit-identical to
        lse_from(*combine(max, mass)): NaN when non-finite."""
        big, mass = self.combine()
        lse = self.np_lse
        torch.log(mass, out=self.lse)
        np.add(lse, big, out=lse)  # fl(log S + M) == fl(M + log S)
        finite = np.isfinite(lse)
        self.finite = bool(finite.all())
        if not self.finite:
            lse[~finite] = np.float32(NAN)
        return lse

    def best(self, lse: np.ndarray, take: int) -> tuple[Best, np.ndarray]:
        """Launch 3: (each row's best min(take, valid, 32) lanes, bool [rows] exact).

        The best 2 x 32 candidates by value contain every candidate valued at least the
        take-th best when the next one is below it. When that and select()'s bound are below
        the take-th best value, ordering those 64 by (value desc, id asc), -0.0 equal to
        +0.0, gives the row's exact best `take`, as the sort keys rank them. Otherwise (ties
        across a boundary, rows of -inf) and for a non-finite lse the row is not exact and
        must be recomputed (exact_keys).
        """
        lanes, raw, bound = self.candidates
        if self.rows == 1:
            return self._best_row(lanes, raw, bound, lse, take)
        rix = self.row_index
        values = raw - lse
        if lanes is None:
            lanes = self.lane_ids
        if bound is not None:
            bound = bound - lse
        width = values.shape[1]
        m = min(take, TOP, width)
        if width > 2 * TOP:
            part = np.argpartition(values, width - 2 * TOP - 1, axis=1)
            inner = values[rix, part[:, width - 2 * TOP - 1 : width - 2 * TOP]]
            keep = part[:, width - 2 * TOP :]
            lanes, values = lanes[rix, keep], values[rix, keep]
            bound = inner if bound is None else np.maximum(bound, inner)
        order = np.lexsort((lanes, -values), axis=1)[:, :m]
        values = values[rix, order] + np.float32(0.0)
        ids = lanes[rix, order]
        if bound is None:
            exact = np.isfinite(lse[:, 0])
        else:
            exact = bound[:, 0] < values[:, m - 1]
        return Best(ids, values), exact

    @staticmethod
    def _best_row(lanes: np.ndarray | None, raw: np.ndarray, bound: np.ndarray | None,
                  lse: np.ndarray, take: int) -> tuple[Best, np.ndarray]:
        """best() for a one-row block, on 1-D arrays."""
        shift = lse[0, 0]
        values = raw[0] - shift
        lanes = None if lanes is None else lanes[0]
        bound = None if bound is None else bound[0, 0] - shift
        width = values.shape[0]
        m = min(take, TOP, width)
        if width > 2 * TOP:
            part = np.argpartition(values, width - 2 * TOP - 1)
            inner = values[part[width - 2 * TOP - 1]]
            keep = part[width - 2 * TOP :]
            lanes = keep if lanes is None else lanes[keep]
            values = values[keep]
            bound = inner if bound is None else max(bound, inner)
        elif lanes is None:
            lanes = np.arange(width)
        order = np.lexsort((lanes, -values))[:m]
        values = values[order] + np.float32(0.0)
        if bound is None:
            exact = np.isfinite(shift)
        else:
            exact = bound < values[m - 1]
        return Best(lanes[order][None], values[None]), np.array([exact])


class _Blocks(threading.local):
    def __init__(self) -> None:
        self.cache: OrderedDict[tuple, RowBlock] = OrderedDict()
        self.nbytes = 0


_BLOCKS = _Blocks()


def row_block(rows: int, geo: Geometry) -> RowBlock:
    """This thread's RowBlock for the configuration, kept between calls (least recently
    used first out beyond SCRATCH_BYTES in all)."""
    key = (rows, geo)
    cache = _BLOCKS.cache
    block = cache.get(key)
    if block is not None:
        cache.move_to_end(key)
        return block
    block = cache[key] = RowBlock(rows, geo)
    _BLOCKS.nbytes += block.nbytes
    while _BLOCKS.nbytes > SCRATCH_BYTES and len(cache) > 1:
        _, old = cache.popitem(last=False)
        _BLOCKS.nbytes -= old.nbytes
    return block


def scratch_bytes() -> int:
    """Bytes of whole-row block scratch this thread keeps between calls."""
    return _BLOCKS.nbytes


def release_scratch() -> None:
    """Drop this thread's kept whole-row block scratch."""
    _BLOCKS.cache.clear()
    _BLOCKS.nbytes = 0


def chunk_maxima(
    logits: torch.Tensor, rows: torch.Tensor | None, valid: int, tile: int = TILE_LANES
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_max, tail_max) as launch 1 (tile_stats) records them, from the native logits."""
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


def exact_keys(
    logits: torch.Tensor,
    rows: torch.Tensor,
    valid: int,
    lse: torch.Tensor,
    take: int,
    id_base: int = 0,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """Launch 3 tile by tile (tile_candidates) for `rows` of `logits` with their lse [m]:
    the exact best `take` keys, EMPTY_KEY-padded."""
    cmax, tail = chunk_maxima(logits, rows, valid, tile)
    keys = tile_candidates(logits, rows, valid, lse, cmax, tail, id_base, tile)
    return top_keys(keys.flatten(1), take)


def natural_best(
    block: RowBlock,
    logits: torch.Tensor,
    rows: np.ndarray,
    lse: np.ndarray,
    take: int,
    tile: int = TILE_LANES,
) -> Best:
    """The exact best `take` (ids before any shard offset) of every row of a loaded block:
    RowBlock.best, and tile_candidates for the rows it cannot vouch for. `rows`: the block
    rows' indices in `logits`."""
    best, exact = block.best(lse, take)
    if exact.all():
        return best
    redo = np.flatnonzero(~exact)
    keys = exact_keys(logits, torch.from_numpy(rows[redo]), block.geo.valid,
                      torch.from_numpy(lse[redo, 0]), best.ids.shape[1], 0, tile)
    empty = (keys == EMPTY_KEY).numpy()
    ids, values = best.ids.copy(), best.values.copy()
    ids[redo] = np.where(empty, -1, key_ids(keys).numpy())
    values[redo] = np.where(empty, np.float32(NAN), key_values(keys).numpy())
    return Best(ids, values, bool(empty.any()))


def _reduce_block(
    logits: torch.Tensor,
    request: NumpyRequest,
    rows: np.ndarray,
    geo: Geometry,
    out: np.ndarray,
    tile: int,
    any_selected: bool,
) -> None:
    """The four launches on the flagged rows `rows` (consecutive or not) as one whole-row
    block; writes their payload rows of `out` (a numpy view of the int32 output)."""
    b = rows.shape[0]
    block = row_block(b, geo)
    first = int(rows[0])
    span = first + b
    consecutive = int(rows[-1]) == span - 1
    if consecutive:
        block.load(logits[first:span, : geo.valid])
    else:
        block.load(logits[:, : geo.valid].index_select(0, torch.from_numpy(rows)))
    payload = out[first:span] if consecutive else np.empty((b, PAYLOAD_WORDS), np.int32)
    chosen = request.chosen[rows]
    payload[:, CHOSEN_ID] = chosen
    chosen_value = block.np_raw[block.row_index, chosen[:, None]]
    selected = None
    if any_selected:
        counts = request.counts[rows]
        picked = np.flatnonzero(counts > 0)
        if picked.size:
            sel = request.ids[rows[picked]].astype(np.int64)
            live = np.arange(MAX_TOKEN_IDS) < counts[picked, None]
            selected = (picked, sel, live, block.np_raw[picked[:, None], np.where(live, sel, 0)])
    block.stats(select=bool(request.k) and (not any_selected or bool((counts == 0).any())))
    lse = block.normalization()
    chosen_value -= lse
    # (x - lse in numpy; torch computes it as fma(lse, -1, x), which returns lse's NaN when
    #  both are NaN: rows with a NaN lse report exactly that canonical NaN)
    bad = None if block.finite else np.isnan(lse[:, 0])
    if bad is not None:
        chosen_value[bad] = lse[bad]
    payload[:, CHOSEN_BITS] = chosen_value.view(np.int32)[:, 0]
    pairs = payload[:, FIRST_PAIR:].reshape(b, MAX_TOKEN_IDS, 2)
    k = request.k
    natural = slice(None)
    if not any_selected:
        pairs[:, k:] = -1
    else:
        pairs[:] = -1
        if selected is not None:
            # 9. (final_merge) selected IDs read their raw logits minus the same lse, caller
            #    order; slots beyond the count may hold stale ids and read lane 0 instead.
            picked, sel, live, values = selected
            values -= lse[picked]
            if bad is not None:
                values[bad[picked]] = np.float32(NAN)
            pairs[picked, :, 0] = np.where(live, sel, -1)
            pairs[picked, :, 1] = np.where(live, values.view(np.int32), -1)
        natural = np.flatnonzero(counts == 0)
        if not natural.size:
            k = 0
    if k:
        best = natural_best(block, logits, rows, lse, k, tile)
        ids, bits = best.ids, best.values.view(np.int32)
        if best.missing:
            bits = np.where(ids < 0, np.int32(-1), bits)
        m = ids.shape[1]
        if isinstance(natural, slice):
            pairs[:, :m, 0] = ids
            pairs[:, :m, 1] = bits
        else:
            got = np.empty((natural.size, m, 2), np.int32)
            got[:, :, 0] = ids[natural]
            got[:, :, 1] = bits[natural]
            pairs[natural, :m] = got
        if m < k:
            pairs[natural, m:k] = -1
    if not consecutive:
        out[rows] = payload


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


def numpy_request(request: RowRequest) -> NumpyRequest:
    return NumpyRequest(request)


def reduce_torch(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    *,
    tile: int = TILE_LANES,
) -> torch.Tensor:
    """The four launches on the flagged rows of a full-vocabulary [rows, width] block."""
    if logits.device.type == "cpu":
        req = numpy_request(request)
        flagged = np.flatnonzero(req.requested)
        n = flagged.size
        if n == 0:
            return out
        per = block_rows(n, vocab_size, tile, logits.device)
        if per:
            geo = geometry(vocab_size, tile)
            any_selected = bool(req.counts[flagged].any())
            out_np = out.numpy()
            for r0 in range(0, n, per):
                _reduce_block(logits, req, flagged[r0 : r0 + per], geo, out_np, tile,
                              any_selected)
            return out
    rows = flagged_rows(request.requested != 0)
    n = count_rows(rows, logits.shape[0])
    if n == 0:
        return out
    return _reduce_slabs(logits, request, vocab_size, out, rows, n, tile)


def _reduce_slabs(
    logits: torch.Tensor,
    request: RowRequest,
    vocab_size: int,
    out: torch.Tensor,
    rows: torch.Tensor | None,
    n: int,
    tile: int,
) -> torch.Tensor:
    """The four launches slab by slab (rows too wide for a whole-row block)."""
    chosen, ids, counts, k = request.chosen, request.ids, request.counts, request.k
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
