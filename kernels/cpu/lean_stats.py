"""Launch 1 of the CPU fast path (kernels/cpu/lean.py): tile statistics bit for bit equal to
kernels/cpu/tiles.py's ``tile_stats``, in far fewer tensor calls, on the same slabs.

Up to PLAN_LANES lanes per call, a StatsPlan (kept per thread, reused across calls) takes the
chunk and tile maxima straight from the native rows, then per slab only: a slice, the exact
FP32 copy into the slab scratch, the shift subtraction, exp, and the tile sums into place.
Rows too narrow for the chunk prefilter pick CANDIDATES lanes per slab here, before the exp.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from helios_logprobs.kernels.cpu.compiled import compiled_lse, compiled_tile_stats
from helios_logprobs.kernels.cpu.tiles import (
    CHUNK_LANES,
    NAN,
    NEG_INF,
    TileStats,
    slab_budget,
    slabs,
)
from helios_logprobs.kernels.layout import TILE_CANDIDATES as TOP

CANDIDATE_CHUNKS = 2 * TOP
"""Chunks of 16 lanes whose lanes a row ranks in launch 3 (at most a quarter of the row's
chunks): 64, twice the 32 needed, so that ties at the 32nd value (common with bf16 logits)
still leave the next chunk strictly below it."""

PLAN_LANES = 1 << 22
"""Up to this many lanes per call, launch 1 takes the chunk and tile maxima straight from
the native rows (StatsPlan: fewest tensor calls); beyond, the per-slab loop reads them from
each slab's FP32 copy (native bf16 reductions are about 2x slower per lane)."""


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
    narrow = select and not uses_chunks(valid, tile)
    compiled = compiled_tile_stats(logits, rows, valid, tile, CANDIDATES if narrow else 0)
    if compiled is not None:
        stats, found = compiled
        return stats, None if found is None else Candidates(*found)
    n = rows.size
    picks: dict[int, list] | None = {} if narrow else None
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
    compiled = compiled_lse(stats)
    if compiled is not None:
        return compiled
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
