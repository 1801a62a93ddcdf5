"""CPU fast path of the torch reduction (``reduce_lean``), used for CPU tensors.

The same four launches over the same slabs (slabs(), at most SLAB_ELEMENTS lanes and a
quarter of the rows x vocabulary product per FP32 temporary), with far fewer tensor ops:
launch 1 writes its results in place (out= targets, numpy views for the tiny per-slab
steps), launch 3 ranks a handful of candidates per row on numpy instead of the floor
machinery, and the payload is written through numpy views. Every FP32 value, every sum
and every lse is the tile-by-tile path's (same ops on the same slabs), so the payload is
bit for bit that path's; rows whose candidates cannot vouch for their best 32 (ties across
a boundary, rows of -inf, a non-finite lse) take the tile-by-tile launch 3.

Where the compiled launches apply (kernels/cpu/compiled.py: a C compiler, MKL inside
torch, a probe that shows the same bits), the whole call runs there in one C call and this
module only settles the rows it cannot vouch for; otherwise the numpy path below runs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from helios_logprobs.kernels.cpu.compiled import compiled_best, compiled_reduce
from helios_logprobs.kernels.cpu.lean_stats import (
    CANDIDATE_CHUNKS,
    CANDIDATES,
    NAN32,
    Candidates,
    lean_lse,
    lean_tile_stats,
    native_values,
    uses_chunks,
)
from helios_logprobs.kernels.cpu.tiles import (
    CHUNK_LANES,
    TILE_LANES,
    TileStats,
    tile_candidates,
)
from helios_logprobs.kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
)
from helios_logprobs.kernels.layout import TILE_CANDIDATES as TOP
from helios_logprobs.kernels.payload import top_keys
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sortkeys import EMPTY_KEY, key_ids, key_values

LEAN = True
"""Whether CPU tensors take this fast path (tests compare it with the tile-by-tile one)."""


CANDIDATE_ROWS = 32
"""Launch 3 gathers and ranks candidates this many rows at a time (numpy temporaries stay
small)."""


class Best(NamedTuple):
    ids: np.ndarray
    """int64 [n, m] row-relative lanes, best first (value desc, lane asc); -1 where the
    vocabulary has fewer lanes or a row with a non-finite lse has no alternatives."""
    values: np.ndarray
    """FP32 [n, m] their reported values, -0.0 read as +0.0 (as decoded from sort keys)."""
    missing: bool = False
    """Whether any id is -1."""


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
    compiled = compiled_best(logits, rows, valid, tile, stats, picks, lse,
                             min(take, TOP, valid if picks is None else picks.lanes.shape[1]))
    if compiled is not None:
        ids, values, exact = compiled
        return _vouched(Best(ids, values), exact, logits, rows, valid, lse, stats, tile), None
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
    return _vouched(best, exact, logits, rows, valid, lse, stats, tile), more


def _vouched(best: Best, exact: np.ndarray, logits: torch.Tensor, rows: np.ndarray, valid: int,
             lse: np.ndarray, stats: TileStats, tile: int) -> Best:
    """`best` with the rows its candidates could not vouch for (exact False) recomputed by
    the tile-by-tile launch 3."""
    if exact.all():
        return best
    redo = np.flatnonzero(~exact)
    again = exact_best(logits, rows, valid, lse, best.ids.shape[1], stats, redo, tile)
    ids, values = best.ids.copy(), best.values.copy()
    ids[redo], values[redo] = again.ids, again.values
    return Best(ids, values, again.missing)


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


def _reduce_compiled(logits: torch.Tensor, req: NumpyRequest, rows: np.ndarray,
                     counts: np.ndarray, valid: int, out: torch.Tensor, tile: int) -> bool:
    """reduce_lean through compiled.c when it applies (False: nothing to keep): the natural
    rows it cannot vouch for take the tile-by-tile launch 3 here."""
    k, total = req.k, out.shape[0]
    selected = req.ids
    if selected.shape != (total, MAX_TOKEN_IDS) or req.counts.shape != (total,):
        return False
    narrow = k > 0 and not uses_chunks(valid, tile) and bool((counts == 0).any())
    done = compiled_reduce(
        logits, rows, valid, tile, np.ascontiguousarray(req.chosen, dtype=np.int64),
        np.ascontiguousarray(req.counts, dtype=np.int32),
        np.ascontiguousarray(selected, dtype=np.int32), k, narrow, out)
    if done is None:
        return False
    redo, stats, lse = done
    if not redo.any():
        return True
    if (redo == 2).any():
        return False
    which = np.flatnonzero(redo)
    best = exact_best(logits, rows, valid, lse, min(k, TOP, valid), stats, which, tile)
    bits = best.values.view(np.int32)
    if best.missing:
        bits = np.where(best.ids < 0, np.int32(-1), bits)
    out_np = out.numpy()
    block = out_np[rows[which]]
    pairs = block[:, FIRST_PAIR:].reshape(which.size, MAX_TOKEN_IDS, 2)
    m = best.ids.shape[1]
    pairs[:, :m, 0] = best.ids
    pairs[:, :m, 1] = bits
    out_np[rows[which]] = block
    return True


def reduce_lean(logits: torch.Tensor, request: RowRequest, vocab_size: int,
                 out: torch.Tensor, tile: int) -> torch.Tensor:
    """reduce_torch on CPU: the same slabs and launches, lean (see the section comment)."""
    req = NumpyRequest(request)
    rows = np.flatnonzero(req.requested)
    n = rows.size
    if n == 0:
        return out
    k = req.k
    counts = req.counts[rows]
    if _reduce_compiled(logits, req, rows, counts, vocab_size, out, tile):
        return out
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
