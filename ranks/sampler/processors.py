"""The sampler's logits processors, on a shard's scratch rows, in vLLM v1's order: allowed ids
(grammar mask), the blocked ids of min_tokens and bad_words, logit_bias, then the repetition,
frequency and presence penalties (vllm/v1/sample/sampler.py; ranks/sampler/sampler.py runs them
after the scratch copy and before the temperature and the filters).

Every factor and term is a finite float32 and finite lanes saturate at +-LOGIT_LIMIT, so no
lane becomes NaN or +-inf: the only -inf lanes are masked ones, and every row keeps a lane to
pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from helios_logprobs.ranks.grammar_mask import bitmask_words
from helios_logprobs.ranks.sampler.buffers import PlanBuffers
from helios_logprobs.ranks.sampler.params import GREEDY_EPS, RowSampling

NEG_INF = float("-inf")
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23
"""The smallest positive float32 (subnormal): a repetition penalty below it would round to 0."""
LOGIT_LIMIT = FLOAT32_MAX * GREEDY_EPS / 2
"""The largest magnitude bias and penalties leave on a finite lane, so that dividing by any
sampling temperature (>= GREEDY_EPS) keeps it finite: a finite lane never becomes -inf, the
mark of a masked one, nor +inf."""


@dataclass(frozen=True)
class ShardLanes:
    """Where a shard's lanes sit among the global ids: lane j is id vocab_start + j."""

    vocab_start: int
    local_valid: int
    vocab_size: int
    device: torch.device

    def local(self, token_ids: Sequence[int], buffers: PlanBuffers,
              values: Sequence[float] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Lanes of this shard among global ids (and the matching float32 values, clamped to
        float32's range), as views of the plan's buffers."""
        lanes, mine = self.local_lanes(token_ids)
        if values is None:
            return buffers.int64.take(lanes[mine]), None
        with np.errstate(over="ignore"):  # (past float32's range: inf, then clamped)
            vals = np.asarray(values, dtype=np.float64).astype(np.float32)[mine]
        np.clip(vals, -FLOAT32_MAX, FLOAT32_MAX, out=vals)
        return buffers.int64.take(lanes[mine]), buffers.float32.take(vals)

    def local_lanes(self, token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(lane of each id, whether it is on this shard); ValueError outside the vocabulary."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids outside vocabulary [0, {self.vocab_size})")
        lanes = ids - self.vocab_start
        return lanes, (lanes >= 0) & (lanes < self.local_valid)


@dataclass(frozen=True)
class RowMasks:
    """One row's masks and bias as lane tensors of the shard, built in the plan."""

    row: int
    blocked: torch.Tensor | None
    """bool [local_valid]: lanes outside allowed_token_ids (None: no allowed ids)."""
    masked: torch.Tensor | None
    """int64 lanes of the min_tokens stop ids and the banned bad-word ids (None: none)."""
    bias_lanes: torch.Tensor | None
    bias: torch.Tensor | None
    """float32 logit_bias of bias_lanes, clamped to float32's range."""


@dataclass(frozen=True)
class CellChange:
    """One penalty step over cells (row, lane) of the scratch: ``scale`` (the repetition
    penalty: x / f where x > 0, else x * f) or subtract ``value`` (frequency, presence)."""

    scale: bool
    row: torch.Tensor
    lane: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class ProcessorPlan:
    """Every logits processor of a batch of scratch rows, with its lanes and values on the
    shard's device: what apply_processors decides on the host, made before the logits
    exist (the sample phase then only applies tensors)."""

    masks: tuple[RowMasks, ...]
    penalties: tuple[CellChange, ...]

    def apply(self, x: torch.Tensor) -> None:
        """The processors on scratch rows x (float32 [rows, local_valid]), in place."""
        for m in self.masks:
            if m.blocked is not None:
                x[m.row].masked_fill_(m.blocked, NEG_INF)
            if m.masked is not None:
                x[m.row].index_fill_(0, m.masked, NEG_INF)
            if m.bias_lanes is not None:
                old = x[m.row, m.bias_lanes]
                x[m.row, m.bias_lanes] = saturated(old + m.bias, old)
        for change in self.penalties:
            vals = x[change.row, change.lane]
            if change.scale:
                rep = change.value
                new = torch.where(vals > 0, vals / rep, vals * rep)
            else:
                new = vals - change.value
            x[change.row, change.lane] = saturated(new, vals)


def plan_processors(rows: Sequence[RowSampling], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]], shard: ShardLanes,
                    buffers: PlanBuffers) -> ProcessorPlan:
    """The processors of scratch rows ``rows``: per row, allowed ids, blocked ids (min_tokens,
    bad_words) and logit_bias, in that order; then the penalties, last on every row (after
    logit_bias, as in vLLM: the repetition penalty scales the biased logit), batched over the
    rows. Every tensor is a view of ``buffers`` (ranks/sampler/buffers.py)."""
    masks = []
    for i, r in enumerate(rows):
        blocked = masked = bias_lanes = bias = None
        if r.allowed_token_ids is not None or r.grammar_bitmask is not None:
            host, device_rows = buffers.rows(1, shard.local_valid)
            host[0] = r.allowed_token_ids is not None
            if r.allowed_token_ids is not None:
                lanes, mine = shard.local_lanes(r.allowed_token_ids)
                host[0, lanes[mine]] = False
            if r.grammar_bitmask is not None:  # (vLLM masks first; -inf fills commute)
                host[0] |= grammar_blocked(r.grammar_bitmask, shard)
            blocked = device_rows[0]
        ids = list(r.blocked_ids)
        if r.bad_words:
            ids += r.banned_ids(output_ids[i])
        if ids:
            masked, _ = shard.local(ids, buffers)
        if r.logit_bias:
            bias_lanes, bias = shard.local([t for t, _ in r.logit_bias], buffers,
                                           [b for _, b in r.logit_bias])
        if any(t is not None for t in (blocked, masked, bias_lanes)):
            masks.append(RowMasks(i, blocked, masked, bias_lanes, bias))
    penalized = [i for i, r in enumerate(rows) if r.penalized]
    penalties = ()
    if penalized:
        penalties = _penalties(x_rows=len(rows), rows=[rows[i] for i in penalized],
                               which=penalized, prompts=[prompt_ids[i] for i in penalized],
                               outputs=[output_ids[i] for i in penalized], shard=shard,
                               buffers=buffers)
    return ProcessorPlan(tuple(masks), penalties)


def grammar_blocked(row: bytes, shard: ShardLanes) -> np.ndarray:
    """bool [local_valid]: the lanes the grammar bitmask row forbids (the shard's slice, as
    ranks/grammar_mask.py shard_blocked cuts it; numpy, no tensor storage)."""
    words = bitmask_words(shard.vocab_size)
    if len(row) != 4 * words:
        raise ValueError(f"a grammar bitmask row over {shard.vocab_size} ids has "
                         f"{4 * words} bytes, got {len(row)}")
    first, last = shard.vocab_start // 32, -(-(shard.vocab_start + shard.local_valid) // 32)
    skip = shard.vocab_start - 32 * first  # (the shard's first id within its first word)
    bits = np.unpackbits(np.frombuffer(row, dtype=np.uint8)[4 * first:4 * last],
                         bitorder="little").view(bool)
    return ~bits[skip:skip + shard.local_valid]


def _penalties(x_rows: int, rows: Sequence[RowSampling], which: list[int],
               prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
               shard: ShardLanes, buffers: PlanBuffers) -> tuple[CellChange, ...]:
    """The repetition, frequency and presence penalties of rows x[which] (rows[k] is row
    which[k]), one after the other, each over the (row, lane) cells it changes in all rows
    at once: per cell the same float32 operations as one row at a time. A row whose penalty
    is off is left out of that step (a factor of 1 or a term of 0 would still clamp a logit
    past LOGIT_LIMIT). The cells are found with numpy (a few small arrays: torch's per-op
    cost would exceed the work)."""
    n_rows = x_rows
    changes = []
    cells, counts = np.unique(_cells(shard, which, outputs), return_counts=True)
    # Every factor and term is a positive / finite float32, so no lane becomes NaN: a
    # penalty that rounds to 0 or inf in float32 would turn a masked lane's -inf (times
    # 0) or a zero logit (times inf) into NaN, which no pick can rank.
    repeated = [k for k, r in enumerate(rows) if r.repetition_penalty != 1]
    if repeated:
        rows_of = [which[k] for k in repeated]
        seen = np.unique(np.concatenate((
            _cells(shard, rows_of, [prompts[k] for k in repeated]),
            cells[_of_rows(cells, rows_of, n_rows, shard)])))
        rep = _per_cell(seen, rows_of, [rows[k].repetition_penalty for k in repeated], n_rows,
                        shard)
        np.clip(rep, FLOAT32_TINY, FLOAT32_MAX, out=rep)
        changes.append(CellChange(True, *_indices(seen, shard, buffers),
                                  buffers.float32.take(rep)))
    # Then frequency (-= f * count) and presence (-= p) over the output's cells.
    for name, per_count in (("frequency_penalty", True), ("presence_penalty", False)):
        active = [k for k, r in enumerate(rows) if getattr(r, name) != 0]
        if not active:
            continue
        rows_of = [which[k] for k in active]
        mine = _of_rows(cells, rows_of, n_rows, shard)
        term = _per_cell(cells[mine], rows_of, [getattr(rows[k], name) for k in active],
                         n_rows, shard)
        np.clip(term, -FLOAT32_MAX, FLOAT32_MAX, out=term)
        if per_count:
            with np.errstate(over="ignore"):  # (float32 products past the range: clamped)
                term = term * counts[mine].astype(np.float32)
            np.clip(term, -FLOAT32_MAX, FLOAT32_MAX, out=term)
        changes.append(CellChange(False, *_indices(cells[mine], shard, buffers),
                                  buffers.float32.take(term)))
    return tuple(changes)


def _cells(shard: ShardLanes, which: Sequence[int], ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Cells row * local_valid + lane (int64) of every id of ids[k] on this shard, in row
    which[k]; ValueError for an id outside the vocabulary."""
    lengths = [len(each) for each in ids]
    flat = np.array(list(chain.from_iterable(ids)), dtype=np.int64)  # (faster than fromiter)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= shard.vocab_size):
        raise ValueError(f"token ids outside vocabulary [0, {shard.vocab_size})")
    lanes = flat - shard.vocab_start
    rows = np.repeat(np.asarray(which, dtype=np.int64), lengths)
    mine = (lanes >= 0) & (lanes < shard.local_valid)
    return rows[mine] * shard.local_valid + lanes[mine]


def _of_rows(cells: np.ndarray, which: Sequence[int], n_rows: int,
             shard: ShardLanes) -> np.ndarray:
    """bool per cell: its row is one of `which`."""
    chosen = np.zeros(n_rows, dtype=bool)
    chosen[list(which)] = True
    return chosen[cells // max(shard.local_valid, 1)]


def _per_cell(cells: np.ndarray, which: Sequence[int], values: Sequence[float], n_rows: int,
              shard: ShardLanes) -> np.ndarray:
    """float32 per cell: values[k], rounded to float32, for the cells of row which[k]; one
    float32 when every row has the same value (the same operations, broadcast)."""
    with np.errstate(over="ignore"):  # (past float32's range: inf, as torch.tensor rounds it)
        if all(value == values[0] for value in values):
            return np.asarray([values[0]], dtype=np.float64).astype(np.float32)
        table = np.ones(n_rows, dtype=np.float32)
        table[list(which)] = np.asarray(values, dtype=np.float64).astype(np.float32)
    return table[cells // max(shard.local_valid, 1)]


def _indices(cells: np.ndarray, shard: ShardLanes, buffers: PlanBuffers
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, lane) int64 tensors of the cells, for x[row, lane]."""
    width = max(shard.local_valid, 1)
    return buffers.int64.take(cells // width), buffers.int64.take(cells % width)


def saturated(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` with the lanes that were finite in ``old`` kept within +-LOGIT_LIMIT: a finite
    logit that a penalty or bias pushes past float32's range (or past what a temperature can
    divide) stays the most extreme finite value instead of becoming +-inf. Values within the
    limit, and lanes that were already infinite, are unchanged."""
    return torch.where(old.isfinite(), new.clamp(-LOGIT_LIMIT, LOGIT_LIMIT), new)
