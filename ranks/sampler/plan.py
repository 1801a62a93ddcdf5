"""The sampler's host decisions for one batch of rows, made before the logits exist.

``ShardedSampler.plan`` (called by the step's prepare phase) reads the rows' parameters on
the host once: it checks them, sorts the rows into the paths that will pick them (on the CPU,
compiled code takes unprocessed greedy and temperature-only rows from the raw logits; every
other row goes through the scratch), and builds every index, parameter and processor tensor
those paths read: row indices, temperatures, seeds and positions, top-k counts and how many
values the top-k exchange sends, min-p floors, top-k and top-p targets, processor lanes and
penalty cells, each a view of the sampler's static pools (ranks/sampler/buffers.py: the plan
allocates no tensor storage; its tensors are valid until the sampler's next plan).
``ShardedSampler.run`` then applies tensors only. On the capture-safe path
(CUDA, or ``capture_safe=True``) the plan is final: no tensor value is read on the host and
no tensor is built from host data while sampling (tests/unit/ranks/test_capture_sample.py).
On the CPU's compiled path a temperature row the candidate search leaves (more than 512
candidates, an infinite value) falls back to the scratch at run time; the plan then builds
that scratch part on demand (``SamplePlan.scratch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.ranks.sampler.buffers import PlanBuffers
from helios_logprobs.ranks.sampler.filters import TOPK_WIDTH
from helios_logprobs.ranks.sampler.params import SEED_MAX, RowSampling
from helios_logprobs.ranks.sampler.processors import (
    FLOAT32_MAX,
    ProcessorPlan,
    ShardLanes,
    plan_processors,
)


@dataclass(frozen=True)
class PlanShape:
    """What the plan needs to know of the sampler: its shard and where tensors live."""

    lanes: ShardLanes
    max_rows: int
    world: int
    native: bool
    """Whether compiled CPU code may take rows (False on the capture-safe path)."""
    buffers: PlanBuffers
    """The static storage every tensor of the plan is a view of (ranks/sampler/buffers.py)."""

    @property
    def device(self) -> torch.device:
        return self.lanes.device


def index_tensor(values: Sequence[int], buffers: PlanBuffers) -> torch.Tensor:
    return buffers.int64.take(values)


def float64_tensor(values: Sequence[float], buffers: PlanBuffers) -> torch.Tensor:
    return buffers.float64.take([float(t) for t in values])


@dataclass(frozen=True)
class FilterRows:
    """One filter's rows of the scratch block: their numbers, their index (None: every row
    of the block), their positions among the filtered rows (for the exchanged maxima) and
    their per-row values (min-p floors, top-k counts or top-p masses, float64)."""

    rows: list[int]
    index: torch.Tensor | None
    maxima: torch.Tensor | None
    values: torch.Tensor


@dataclass(frozen=True)
class FilterPlan:
    """min-p, top-k and top-p of a scratch block (ShardedSampler._filter applies them)."""

    index: torch.Tensor | None
    """The filtered rows of the block (None: all of them)."""
    ks: torch.Tensor
    """int64 [filtered]: top-k counts of rows with top-k <= TOPK_WIDTH, else 1."""
    take: int
    """Values each shard sends in the top-k exchange: min(max(ks), local_valid)."""
    small: torch.Tensor | None
    """bool [filtered]: rows with a small top-k (None: no such row)."""
    filtered: int
    min_p: FilterRows | None
    large: FilterRows | None
    top_p: FilterRows | None


def _filter_rows(which: list[int], filtered: list[int], n: int, values: list[float],
                 buffers: PlanBuffers, maxima: bool) -> FilterRows | None:
    if not which:
        return None
    position = {row: k for k, row in enumerate(filtered)}
    spots = [position[i] for i in which]
    return FilterRows(
        which, None if len(which) == n else index_tensor(which, buffers),
        index_tensor(spots, buffers) if maxima and spots != list(range(len(filtered))) else None,
        float64_tensor(values, buffers))


def plan_filters(rows: Sequence[RowSampling], vocab_size: int, local_valid: int,
                 buffers: PlanBuffers) -> FilterPlan | None:
    n, v = len(rows), vocab_size
    filtered = [i for i, r in enumerate(rows) if r.filtered(v)]
    if not filtered:
        return None
    small = [rows[i].top_k_active(v) and rows[i].top_k <= TOPK_WIDTH for i in filtered]
    ks = [rows[i].top_k if s else 1 for i, s in zip(filtered, small, strict=True)]
    min_p = [i for i in filtered if rows[i].min_p > 0]
    large = [i for i in filtered if rows[i].top_k_active(v) and rows[i].top_k > TOPK_WIDTH]
    top_p = [i for i in filtered if rows[i].top_p < 1]
    return FilterPlan(
        index=None if len(filtered) == n else index_tensor(filtered, buffers),
        ks=index_tensor(ks, buffers),
        take=min(max(ks), local_valid),
        small=buffers.bool.take(small) if any(small) else None,
        filtered=len(filtered),
        min_p=_filter_rows(min_p, filtered, n, [rows[i].min_p for i in min_p], buffers, True),
        large=_filter_rows(large, filtered, n, [rows[i].top_k for i in large], buffers, False),
        top_p=_filter_rows(top_p, filtered, n, [rows[i].top_p for i in top_p], buffers, True),
    )


@dataclass(frozen=True)
class DenseRows:
    """Every scratch row's flags in fixed shapes [rows] (ranks/sampler/ops.py sample_best):
    greedy (bool), seed and position (int64; 0 for greedy rows, whose noise is unused)."""

    greedy: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class ScratchPlan:
    """The rows that go through the scratch (rows ``which`` of the logits; None: all)."""

    rows: tuple[RowSampling, ...]
    which: torch.Tensor | None
    scale: torch.Tensor
    """float32 [rows]: each row's temperature (1 for greedy rows), clamped to float32's max."""
    scaled: bool
    unprocessed: bool
    processors: ProcessorPlan
    filters: FilterPlan | None
    greedy: torch.Tensor | None
    """Greedy rows among them, when some rows are sampled too (else None)."""
    seeded: torch.Tensor | None
    """Sampled rows among them (None: every row is greedy)."""
    seeds: torch.Tensor | None
    positions: torch.Tensor | None
    """int64 [seeded rows]: their seeds (as the signed words Philox reads) and positions."""
    dense: DenseRows | None = None
    """The capture-safe path's per-row tensors over every row (None on the CPU's path)."""

    @property
    def n(self) -> int:
        return len(self.rows)


def plan_scratch(shape: PlanShape, rows: Sequence[RowSampling],
                 prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                 which: list[int] | None) -> ScratchPlan:
    buffers = shape.buffers
    temps = [1.0 if r.greedy else r.temperature for r in rows]
    scale = float32_tensor(temps, buffers)  # (clamped: +inf / +inf would be NaN)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    seeded = [i for i, r in enumerate(rows) if not r.greedy]
    lanes = shape.lanes
    return ScratchPlan(
        rows=tuple(rows),
        which=None if which is None else index_tensor(which, buffers),
        scale=scale,
        scaled=any(t != 1.0 for t in temps),
        unprocessed=all(r.unprocessed for r in rows),
        processors=plan_processors(rows, prompt_ids, output_ids, lanes, buffers),
        filters=plan_filters(rows, lanes.vocab_size, lanes.local_valid, buffers),
        greedy=index_tensor(greedy, buffers) if greedy and seeded else None,
        seeded=index_tensor(seeded, buffers) if seeded else None,
        seeds=index_tensor([signed_seed(rows[i].seed) for i in seeded], buffers)
        if seeded else None,
        positions=index_tensor([rows[i].position for i in seeded], buffers) if seeded else None,
        dense=None if shape.native else DenseRows(
            buffers.bool.take([r.greedy for r in rows]),
            index_tensor([0 if r.greedy else signed_seed(r.seed) for r in rows], buffers),
            index_tensor([0 if r.greedy else r.position for r in rows], buffers)),
    )


class SamplePlan:
    """One sample call's rows, checked and sorted, with the tensors their paths read."""

    def __init__(self, shape: PlanShape, rows: Sequence[RowSampling],
                 prompt_ids: Sequence[Sequence[int]],
                 output_ids: Sequence[Sequence[int]]) -> None:
        n = len(rows)
        if not 1 <= n <= shape.max_rows:
            raise ValueError(f"rows: expected 1..{shape.max_rows}, got {n}")
        if len(prompt_ids) != n or len(output_ids) != n:
            raise ValueError(f"prompt_ids and output_ids: expected {n} lists each")
        vocab_size = shape.lanes.vocab_size
        for i, r in enumerate(rows):
            if r.max_token_id() >= vocab_size:
                raise ValueError(f"rows[{i}]: token id {r.max_token_id()} outside vocabulary")
        self.shape = shape
        shape.buffers.reset()
        self.rows = tuple(rows)
        self.prompt_ids, self.output_ids = prompt_ids, output_ids
        self.native = shape.native
        native = shape.native and shape.lanes.local_valid > 0
        self.plain_greedy = [i for i, r in enumerate(rows) if r.greedy and r.unprocessed] \
            if native else []
        """Rows compiled code picks from the raw logits (CPU): greedy, no processor."""
        self.plain = [i for i, r in enumerate(rows) if not r.greedy and r.unprocessed
                      and not r.filtered(vocab_size)] if native else []
        """Rows compiled code searches in the raw logits (CPU): temperature only."""
        self.greedy_only = native and len(self.plain_greedy) == n and shape.world == 1
        """One rank and only plain greedy rows: the raw argmax is the pick."""
        self.all_greedy = all(r.greedy for r in rows)
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self._scratch: dict[tuple[tuple[int, ...], bool], ScratchPlan] = {}
        self.plain_temperatures = self.plain_seeds = self.plain_positions = None
        if self.plain:
            self.plain_temperatures = float32_tensor([rows[i].temperature for i in self.plain],
                                                     shape.buffers)
            self.plain_seeds = [signed_seed(rows[i].seed) for i in self.plain]
            self.plain_positions = [rows[i].position for i in self.plain]
        for which in (self.plain_greedy, self.plain):
            if which:
                self.index(which)
        taken = set(self.plain_greedy) | set(self.plain)
        rest = [i for i in range(n) if i not in taken]
        if rest and not self.greedy_only:
            self.index(rest)
            self.scratch(rest, bool(taken))
        shape.buffers.upload()

    @property
    def n(self) -> int:
        return len(self.rows)

    def index(self, which: Sequence[int]) -> torch.Tensor:
        """int64 row numbers `which` on the sampler's device (built once per plan)."""
        key = tuple(which)
        found = self._indices.get(key)
        if found is None:
            found = self._indices[key] = index_tensor(key, self.shape.buffers)
        return found

    def scratch(self, rest: Sequence[int], taken: bool) -> ScratchPlan:
        """The scratch plan of rows `rest` (taken: other rows were picked elsewhere, so the
        scratch reads rows `rest` of the logits; else every row, in order)."""
        key = (tuple(rest), taken)
        found = self._scratch.get(key)
        if found is None:
            found = self._scratch[key] = plan_scratch(
                self.shape, [self.rows[i] for i in rest], [self.prompt_ids[i] for i in rest],
                [self.output_ids[i] for i in rest], list(rest) if taken else None)
            self.shape.buffers.upload()  # (on the CPU's run-time fallback: a no-op)
        return found


FILLER = RowSampling(seed=0, position=0, temperature=0.0)
"""A bucket's padding row: greedy, no processor or filter (its token is not read)."""


def pad_rows(rows: Sequence[RowSampling], prompt_ids: Sequence[Sequence[int]],
             output_ids: Sequence[Sequence[int]], bucket: int
             ) -> tuple[list[RowSampling], list[Sequence[int]], list[Sequence[int]]]:
    """The plan's arguments padded with FILLER rows to ``bucket`` rows, so that a compiled
    sample phase sees one shape per bucket (the logits' padded rows are any finite values;
    tokens past len(rows) are ignored)."""
    if bucket < len(rows):
        raise ValueError(f"bucket {bucket} is smaller than the {len(rows)} rows")
    extra = bucket - len(rows)
    return ([*rows, *[FILLER] * extra], [*prompt_ids, *[()] * extra],
            [*output_ids, *[()] * extra])


def float32_tensor(values: Sequence[float], buffers: PlanBuffers) -> torch.Tensor:
    """float32 values (rounded as torch.tensor rounds them), clamped to float32's max."""
    with np.errstate(over="ignore"):
        host = np.asarray(values, dtype=np.float64).astype(np.float32)
    return buffers.float32.take(np.minimum(host, FLOAT32_MAX))


def signed_seed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 the Philox keys are read from."""
    return seed - SEED_MAX if seed >= 2**63 else seed
