"""The sampler's Gumbel-max: each shard's best (score key, global id) of its rows.

A row's score of lane j is float64(x[j]) + gumbel_noise(seed, position, vocab_start + j); the
best is the largest score key (score_keys), the smallest global id among equal keys. Every
path below picks exactly that lane; they only differ in how much noise they evaluate and where
(torch, or compiled code: on CPU it narrows a dense row to its few possible winners, and scores
a sparse row's remaining lanes itself).
"""

from __future__ import annotations

import math
import threading

import torch

from helios_logprobs.kernels.noise.philox import (
    BOUND_OFFSET,
    BOUND_SCALE,
    GUMBEL_SPAN,
    gumbel_bounds,
    gumbel_noise,
    philox_bits,
    seed_words,
    uniform_of,
)
from helios_logprobs.kernels.noise.philox_native import (
    Candidates,
    native_candidates,
    native_cutoff_lanes,
    native_scaled_best,
    native_sparse_best,
    scores_candidates,
)
from helios_logprobs.ranks.sampler.filters import NO_ID, empty_best, score_keys

ROW_NOISE_MIN_WIDTH = 16384
"""Rows at least this wide with most lanes still candidates draw noise row by row."""

DENSE_X_LIMIT = 1e6
"""Rows whose largest |logit| exceeds this draw every lane's noise exactly (the pruning
margins below assume scores of moderate size)."""

BLOCK = 128
"""Lanes per block of the dense path's candidate search (block maxima of the bounds)."""

_ESTIMATE_STRIDE = 128


def gumbel_best(
    x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local Gumbel-max of float64(x) + noise(seed, position, global id): (score key, id).

    Noise lies in [GUMBEL_MIN, GUMBEL_MAX], so a lane more than GUMBEL_SPAN below the row's
    local max can never beat the max lane's score; the margin keeps that strict after float64
    rounding, so skipping such lanes never changes the winner. Lanes that remain are scored
    exactly (_sparse_rows: compiled code on CPU, else one flat torch call with per-lane keys),
    except in wide rows where most lanes remain: those draw their Philox bits row by row with
    scalar keys and evaluate the noise exactly only where it can still decide the winner
    (_dense_rows: compiled code on CPU, else dense_row_best).
    """
    n, width = x.shape
    best, best_id = empty_best(n, x.device)
    if width == 0:
        return best, best_id
    xmax = x.amax(dim=1).to(torch.float64)  # values only: 10x cheaper than max(dim)
    margin = 1e-9 + 1e-12 * xmax.abs()
    cutoff = torch.where(torch.isfinite(xmax), xmax - GUMBEL_SPAN - margin, xmax)
    # Compare in float32 against the cutoff rounded down: a superset of the float64 test.
    low = cutoff.to(torch.float32)
    low = torch.where(low.to(torch.float64) > cutoff, torch.nextafter(low, low - 1), low)
    dense: list[int] = []
    if width >= ROW_NOISE_MIN_WIDTH:
        # Which path a row takes only decides speed (both are exact), so every 128th lane
        # is enough to estimate whether most lanes remain candidates (every 16th read one
        # lane per cache line: a whole pass over the rows).
        sample = x[:, ::_ESTIMATE_STRIDE] >= low.unsqueeze(1)
        dense = torch.nonzero(sample.sum(dim=1) * 2 > sample.shape[1]).flatten().tolist()
    if dense:
        _dense_rows(x, dense, seeds, positions, vocab_start, xmax, best, best_id)
    if len(dense) < n:
        _sparse_rows(x, dense, low, seeds, positions, vocab_start, best, best_id)
    return best, best_id


def _sparse_rows(x: torch.Tensor, dense: list[int], low: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor, vocab_start: int, best: torch.Tensor,
                 best_id: torch.Tensor) -> None:
    """best and best_id of the rows not in `dense`: each lane at or above its row's cutoff
    scores exactly (compiled code on CPU, else torch)."""
    taken = set(dense)
    sparse = [i for i in range(x.shape[0]) if i not in taken]
    if native_sparse_best(x, sparse, low, seeds, positions, vocab_start, best, best_id):
        return
    row, lane = _sparse_lanes(x, sparse, dense, low)
    if row.numel():
        values = x[row, lane].to(torch.float64)
        ids = lane + vocab_start
        _settle(best, best_id, row, ids, values + gumbel_noise(seeds[row], positions[row], ids))


def _sparse_lanes(x: torch.Tensor, sparse: list[int], dense: list[int],
                  low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, lane) of the lanes at or above their row's cutoff in the rows `sparse` (the
    others, `dense`, are left out; compiled code on CPU, else torch.nonzero)."""
    found = native_cutoff_lanes(x, sparse, low)
    if found is not None:
        return found
    if not dense:
        return torch.nonzero(x >= low.unsqueeze(1), as_tuple=True)
    rows = torch.tensor(sparse, device=x.device)
    row, lane = torch.nonzero(x.index_select(0, rows) >= low.index_select(0, rows).unsqueeze(1),
                              as_tuple=True)
    return rows.index_select(0, row), lane


def _settle(best: torch.Tensor, best_id: torch.Tensor, row: torch.Tensor, ids: torch.Tensor,
            scores: torch.Tensor) -> None:
    """Fold candidate lanes (their rows, global ids and exact float64 scores) into the rows'
    best (score key, id): the largest key, the smallest id among equal keys."""
    key = score_keys(scores)
    best.scatter_reduce_(0, row, key, reduce="amax")
    tied = torch.where(key == best[row], ids, NO_ID)
    best_id.scatter_reduce_(0, row, tied, reduce="amin")


def _dense_rows(x: torch.Tensor, dense: list[int], seeds: torch.Tensor, positions: torch.Tensor,
                vocab_start: int, xmax: torch.Tensor, best: torch.Tensor,
                best_id: torch.Tensor) -> None:
    """best and best_id of the dense rows. Compiled code finds the few lanes of each that
    can still win (native_candidates), and their exact scores are computed here, as
    dense_row_best computes them; rows it cannot take go through dense_row_best."""
    width = x.shape[1]
    maxima = xmax.tolist()
    plain = [i for i in dense if math.isfinite(maxima[i]) and abs(maxima[i]) <= DENSE_X_LIMIT]
    found = None
    if plain and vocab_start + width <= 2**31 and x.device.type == "cpu":
        seed_list, position_list = seeds.tolist(), positions.tolist()
        found = native_candidates(x, plain, [seed_list[i] for i in plain],
                                  [position_list[i] for i in plain], vocab_start,
                                  BOUND_OFFSET, BOUND_SCALE, DENSE_X_LIMIT,
                                  torch.get_num_threads())
    rest = dense
    if found is not None:
        searched = set(plain) - set(found.left)
        rest = [i for i in dense if i not in searched]
        _settle_candidates(best, best_id, found, vocab_start)
    for i in rest:
        key, lane = dense_row_best(x[i], int(seeds[i]), int(positions[i]), vocab_start,
                                   maxima[i])
        best[i], best_id[i] = key, lane + vocab_start


def scaled_gumbel_best(raw: torch.Tensor, rows: list[int], temperatures: torch.Tensor,
                       seeds: list[int], positions: list[int], vocab_start: int
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """gumbel_best of rows `rows` of raw divided by their temperatures (float32
    [len(rows)]; NaN lanes as -inf), as the sampler's scratch would hold them, without
    writing them anywhere: compiled code reads the raw rows once for every lane's bits and
    bound (the dense path's search) and scores the few candidates (with torch's float64 log
    where this machine allows, else in torch). (score key, id) [len(rows)]; None where that
    does not apply (no compiler, not CPU FP32, ids past 2**31, or a row the search leaves):
    the caller takes the scratch path."""
    width = raw.shape[1]
    if width == 0 or vocab_start + width > 2**31:
        return None
    threads = torch.get_num_threads()
    if scores_candidates():  # (None from here: a row the search left, not worth a second one)
        return native_scaled_best(raw, rows, temperatures, seeds, positions, vocab_start,
                                  BOUND_OFFSET, BOUND_SCALE, DENSE_X_LIMIT, threads)
    found = native_candidates(raw, rows, seeds, positions, vocab_start, BOUND_OFFSET,
                              BOUND_SCALE, DENSE_X_LIMIT, threads, temperatures)
    if found is None or found.left:
        return None
    best, best_id = empty_best(raw.shape[0], raw.device)
    _settle_candidates(best, best_id, found, vocab_start)
    index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
    return best.index_select(0, index), best_id.index_select(0, index)


def _settle_candidates(best: torch.Tensor, best_id: torch.Tensor, found: Candidates,
                       vocab_start: int) -> None:
    """Fold native_candidates' lanes into best and best_id, each scored exactly as
    gumbel_noise scores it."""
    if found.owners:
        row = torch.tensor(found.owners, dtype=torch.int64, device=best.device)
        noise = uniform_of(found.bits).log_().neg_().log_().neg_()
        _settle(best, best_id, row, found.lanes + vocab_start,
                found.values.to(torch.float64) + noise)


class _RowBuffers(threading.local):
    def __init__(self) -> None:
        self.cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


_ROW_BUFFERS = _RowBuffers()
_LANE_IDS: dict[tuple, torch.Tensor] = {}


def _row_buffers(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-thread int64 bits and float32 bounds of one row (fresh large tensors page-fault)."""
    key = (width, str(device))
    cache = _ROW_BUFFERS.cache
    bufs = cache.get(key)
    if bufs is None:
        if len(cache) > 8:
            cache.clear()
        bufs = cache[key] = (torch.empty(width, dtype=torch.int64, device=device),
                             torch.empty(width, dtype=torch.float32, device=device))
    return bufs


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

    Every lane's Philox bits m are drawn (no lane can be skipped without them), and with
    them an FP32 upper bound b = x + gumbel_bounds(m) of each lane's score. The lane with the
    largest b (found through block maxima) gets its exact score s0, a score some lane
    reaches, so the winner scores >= s0. Any lane scoring >= s0 has b >= s0 - margin:
    b exceeds x + noise by 1e-3 before rounding, and FP32 rounding of x + bound moves it by
    at most 2**-24 of its size (monotone rounding), so margin = 1e-3 + 2**-20 (1 + |s0|)
    (|scores| <= DENSE_X_LIMIT + 40) keeps every such lane. Only blocks whose maximum
    reaches that threshold are searched, and only their lanes above it are evaluated.
    """
    width = x.shape[0]
    dev = x.device
    m, bound = _row_buffers(width, dev)
    k0, k1 = seed_words(seed)
    philox_bits(_lane_ids(vocab_start, width, dev), position, k0, k1, out=m, clean=True)
    if not math.isfinite(xmax) or abs(xmax) > DENSE_X_LIMIT or vocab_start + width > 2**31:
        return _exact_best(x, m, torch.arange(width, device=dev))
    gumbel_bounds(m, out=bound).add_(x)
    full = width // BLOCK * BLOCK
    maxima = bound[:full].view(-1, BLOCK).amax(dim=1)
    if full < width:
        maxima = torch.cat((maxima, bound[full:].amax().unsqueeze(0)))
    top = int(torch.argmax(maxima)) * BLOCK
    lead = top + int(torch.argmax(bound[top : top + BLOCK]))
    s0 = key_scores(int(_exact_keys(x, m, torch.tensor([lead], device=dev))[0]))
    floor = s0 - (1e-3 + 2.0**-20 * (1.0 + abs(s0)))
    threshold = float(torch.tensor(floor, dtype=torch.float64).to(torch.float32))
    if threshold > floor:
        threshold = math.nextafter(threshold, -math.inf)
    blocks = torch.nonzero(maxima >= threshold).flatten()
    lanes = (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=dev)).flatten()
    lanes = lanes[lanes < width]
    lanes = lanes[bound.index_select(0, lanes) >= threshold]
    return _exact_best(x, m, lanes)


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


def exact_gumbel_best(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_best with every lane's noise drawn: (score key, global id) of rows x (float32
    [n, width]; ids: int64 [width], the lanes' global ids) in fixed shapes, with no host read
    and no data-dependent branch, so a captured graph or a compiled region can run it (the
    sampler's capture-safe path). Each lane's score is float64(x) + gumbel_noise, exactly as
    the other paths score the lanes they keep, so the winner is theirs: the largest key, the
    smallest id among equal keys."""
    n, width = x.shape
    if width == 0:
        return empty_best(n, x.device)
    noise = gumbel_noise(seeds.unsqueeze(1), positions.unsqueeze(1), ids.unsqueeze(0))
    key = score_keys(x.to(torch.float64) + noise)
    best = key.amax(dim=1)
    best_id = torch.where(key == best.unsqueeze(1), ids.unsqueeze(0), NO_ID).amin(dim=1)
    return best, best_id
