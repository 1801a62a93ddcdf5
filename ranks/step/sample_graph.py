"""The sample phase compiled (--compile): the capture-safe sampler as
``torch.compile(fullgraph=True)`` graphs over padded row buckets and one fixed feature set.

A compiled graph cannot branch on the plan's feature mix without recompiling, so the graph
runs every feature on every row and zero flags make the unused ones no-ops, not host
branches: the scratch copy and the temperature (``helios::sample_scale``), the global row
maxima (one exchange), min-p (a floor of 0 keeps every lane), top-k and top-p as radix
selects (five exchanges each; a row without the filter takes the cut 0, which removes
nothing), then each shard's best (``helios::sample_best``: argmax of greedy rows, Gumbel-max of
the others), the pick exchange and the token write (``helios::sample_pick``). Every exchange
is ``helios::word_exchange`` (collectives/ops.py ``TracedExchange``). Greedy rows get no
filter, as in the eager sampler. The logits processors (grammar masks, blocked ids, logit
bias, penalties: variable-size cells) run eagerly before the graph, exactly as the eager
sampler runs them, into a staging copy that the graph reads with temperature 1 (x / 1 is x).

Rows are padded to a bucket of 1, 2, 4, ... max_rows with greedy filler rows
(ranks/sampler/plan.py ``pad_rows``). Two graphs serve every bucket: a single row's (static)
and the batch's, whose row count is dynamic (>= 2), as in ranks/step/forward_graph.py; each
in three variants, prepare's choice (one per submission, not per row): ``filtered`` (a row
has min-p, top-k or top-p), ``sampled`` (no filter; the Gumbel-max draws every lane's noise)
and ``greedy`` (every row greedy, the common case of evaluation: the argmax alone,
``helios::sample_argmax``). A single filtered row is padded to the bucket of 2 (one greedy
filler row) and runs the batch's filtered graph: the filters' radix selects make that variant
most of the phase's compile time, so a static copy of it would nearly double start-up for
one row's sake. Five graphs in all (six when max_rows is 1: no bucket of 2). Every bucket and
variant runs once at construction (the compiles, then each bucket's guards), so nothing
compiles while serving.

The filters pick the same thresholds as the eager sampler's (k-th largest value with
multiplicity, the same fixed-point masses), so tokens equal the eager capture-safe sampler's,
bit for bit, up to Inductor's own exp in min-p and top-p's masses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helios_logprobs.collectives.ops import TracedExchange, group_name
from helios_logprobs.ranks.sampler import ops as sample_ops
from helios_logprobs.ranks.sampler.filters import (
    key_values,
    max_and_topk,
    pick_global,
    radix_lanes,
    radix_thresholds,
    remove_below_min_p,
)
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.plan import FILLER, SamplePlan, pad_rows

MIN_ROWS, MAX_SIZE = 2, 1 << 24
"""Buckets >= 2 share one graph whose row count is dynamic (dynamo specialises 0 and 1; one
bound for every configuration, as in ranks/step/forward_graph.py)."""
FILTERED, SAMPLED, GREEDY = "filtered", "sampled", "greedy"
VARIANTS = (FILTERED, SAMPLED, GREEDY)
"""The graph variants (region's ``variant``): dynamo specialises on the string."""
LANE_IDS = 9
"""The one argument (``arguments``) not sized [rows, ...]: the lanes' global ids."""
RECOMPILE_LIMIT = 64
"""Dynamo's per-function cache limit while the buckets compile (its default of 8 would fall
back to eager past the eighth bucket)."""


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, ... through max_rows (the last bucket is max_rows itself)."""
    buckets, size = [], 1
    while size < max_rows:
        buckets.append(size)
        size *= 2
    return (*buckets, max_rows)


class SampleGraph:
    def __init__(self, sampler, group: object, compile: bool = True) -> None:
        """``sampler``: the step's capture-safe ShardedSampler (its shard, scratch, tokens)."""
        if not sampler.capture_safe:
            raise ValueError("the compiled sample phase takes the capture-safe sampler")
        self.sampler = sampler
        self.buckets = row_buckets(sampler.max_rows)
        self.exchange = TracedExchange(group_name(group), sampler.pick_exchange.world)
        rows, width, device = sampler.max_rows, sampler.local_width, sampler.device
        self.logits = torch.zeros(rows, width, dtype=torch.float32, device=device)
        """The padded logit rows the graph reads (rows past the submission's are stale)."""
        self.staging = torch.zeros(rows, width, dtype=torch.float32, device=device)
        """Processed plans: the scratch after the eager processors, read at temperature 1."""
        self.ones = torch.ones(rows, dtype=torch.float32, device=device)
        self.params = _RowParams(rows, device)
        self.fn = torch.compile(self.region, fullgraph=True, dynamic=False) if compile \
            else self.region
        self.bucket = self.buckets[0]
        self._marked: set[tuple[bool, str]] = set()
        self.variant = FILTERED
        """prepare's choice of the graph variant: FILTERED where a row of the submission has
        min-p, top-k or top-p; else GREEDY where every row is greedy; else SAMPLED."""
        self.processed = False
        if compile:
            limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
            torch._dynamo.config.cache_size_limit = limit
        for bucket in self.buckets:  # (each variant compiled now, before serving)
            rows_ = [FILLER] * bucket
            self.prepare(sampler.plan(rows_, [()] * bucket, [()] * bucket))
            for variant in VARIANTS:
                if variant == FILTERED and bucket < self.smallest_filtered:
                    continue
                self.variant = variant
                self.run(self.logits[:bucket], bucket)

    @property
    def smallest_filtered(self) -> int:
        """The smallest bucket a filtered submission runs at (2 where there is one)."""
        return min(MIN_ROWS, self.buckets[-1])

    def pad(self, rows: Sequence[RowSampling], prompt_ids: Sequence[Sequence[int]],
            output_ids: Sequence[Sequence[int]]):
        """The plan's arguments padded to the smallest bucket that holds the rows (at least
        ``smallest_filtered`` when a row filters)."""
        vocab = self.sampler.vocab_size
        least = self.smallest_filtered if any(r.filtered(vocab) for r in rows) else 1
        bucket = next(b for b in self.buckets if b >= max(len(rows), least))
        return pad_rows(rows, prompt_ids, output_ids, bucket)

    def prepare(self, plan: SamplePlan) -> None:
        """The host half (prepare phase): the bucket's dense row parameters, written into
        the static buffers the graph reads."""
        self.bucket = plan.n
        vocab = self.sampler.vocab_size
        scratch = plan.scratch(range(plan.n), False)
        filtered = self.params.fill(plan.rows, vocab, scratch)
        greedy = all(r.greedy for r in plan.rows)
        self.variant = FILTERED if filtered else GREEDY if greedy else SAMPLED
        self.processed = bool(scratch.processors.masks or scratch.processors.penalties)
        self._scratch_plan = scratch

    def run(self, logits: torch.Tensor, rows: int) -> torch.Tensor:
        """Tokens int64 [rows] (a view of the sampler's token buffer) of the first ``rows``
        logit rows [rows, local_width]; the rest of the bucket is filler."""
        bucket, valid = self.bucket, self.sampler.local_valid
        self.logits[:rows].copy_(logits)
        if self.processed:  # (the processors run eagerly, as the eager sampler runs them)
            plan = self._scratch_plan
            stage = self.staging[:bucket, :valid]
            sample_ops.sample_scale(self.logits[:bucket, :valid], plan.scale, False, stage)
            plan.processors.apply(stage)
            if plan.scaled:
                stage.div_(plan.scale.unsqueeze(1))
            source, scale = self.staging[:bucket], self.ones[:bucket]
        else:
            source, scale = None, None
        arguments = self.arguments(bucket, source, scale)
        batch = bucket >= MIN_ROWS
        if (batch, self.variant) not in self._marked:  # (each graph's first call compiles it)
            for i, tensor in enumerate(arguments if batch else ()):
                if i != LANE_IDS:  # (every other argument is sized by the rows)
                    torch._dynamo.mark_dynamic(tensor, 0, min=MIN_ROWS, max=MAX_SIZE)
            self._marked.add((batch, self.variant))
        with torch.no_grad():
            self.fn(*arguments, self.variant)
        return self.sampler.tokens[:rows]

    def arguments(self, bucket: int, source: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for a bucket: every one a view of a static buffer (default
        source and scale: the padded logits and the rows' temperatures)."""
        p, s = self.params, self.sampler
        source = self.logits[:bucket] if source is None else source
        scale = p.scale[:bucket] if scale is None else scale
        return (source, scale, p.greedy[:bucket], p.seeds[:bucket], p.positions[:bucket],
                p.min_p[:bucket], p.top_k[:bucket], p.top_p[:bucket], s.scratch[:bucket],
                s.lane_ids, s.best[0, :bucket], s.best[1, :bucket], s.tokens[:bucket])

    def region(self, source, scale, greedy, seeds, positions, min_p, top_k, top_p, scratch,
               lane_ids, keys, ids, tokens, variant: str = FILTERED) -> None:
        s, exchange = self.sampler, self.exchange
        valid = s.local_valid
        x = scratch[:, :valid]
        sample_ops.sample_scale(source[:, :valid], scale, True, x)
        if variant == FILTERED:
            self._filter(x, min_p, top_k, top_p)
        if variant == GREEDY:
            sample_ops.sample_argmax(x, s.vocab_start, keys, ids)
        else:
            sample_ops.sample_best(x, greedy, seeds, positions, lane_ids[:valid],
                                   s.vocab_start, keys, ids)
        sample_ops.sample_pick(pick_global(keys, ids, exchange), tokens)

    def _filter(self, x, min_p, top_k, top_p) -> None:
        """min-p, top-k, top-p on every row of x (zero values: no cut)."""
        s, exchange = self.sampler, self.exchange
        ones = torch.ones_like(top_k, dtype=torch.int64)
        take = 1 if s.local_valid else 0
        max_key, _ = max_and_topk(x, ones, exchange, take=take, native=False)
        maxima = key_values(max_key)
        remove_below_min_p(x, maxima, min_p, native=False)
        for targets, relative in ((top_k, False), (top_p, True)):
            lanes = radix_lanes(x, maxima if relative else None, s.vocab_size, native=False)
            cut = radix_thresholds(lanes, targets, relative, exchange)
            lanes.remove_below(x, torch.where(targets > 0, cut, 0))


class _RowParams:
    """The graph's per-row inputs in fixed buffers [max_rows]: temperature (float32, 1 for
    greedy rows), greedy, seed and position (0 for greedy rows), min-p floor, top-k target
    and top-p mass (float64; 0 where the row has no such filter: the cut is then 0)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        for name, dtype in (("scale", torch.float32), ("greedy", torch.bool),
                            ("seeds", torch.int64), ("positions", torch.int64)):
            setattr(self, name, torch.zeros(rows, dtype=dtype, device=device))
        specs = {"min_p": torch.float64, "top_k": torch.float64, "top_p": torch.float64}
        cuda = device.type == "cuda"
        self._host = {name: torch.zeros(rows, dtype=dtype, pin_memory=cuda)
                      for name, dtype in specs.items()}
        self._arrays = {name: host.numpy() for name, host in self._host.items()}
        for name, host in self._host.items():
            setattr(self, name, host.to(device) if cuda else host)

    def fill(self, rows: Sequence[RowSampling], vocab_size: int, scratch) -> bool:
        """The filters' values from the rows (host); the temperature, greedy flags, seeds and
        positions copied from the scratch plan's tensors (the eager sampler's own values). Returns
        whether any row filters."""
        n, a = len(rows), self._arrays
        self.scale[:n].copy_(scratch.scale)
        self.greedy[:n].copy_(scratch.dense.greedy)
        self.seeds[:n].copy_(scratch.dense.seeds)
        self.positions[:n].copy_(scratch.dense.positions)
        for i, r in enumerate(rows):
            filtered = r.filtered(vocab_size)
            a["min_p"][i] = r.min_p if filtered else 0.0
            a["top_k"][i] = r.top_k if filtered and r.top_k_active(vocab_size) else 0.0
            a["top_p"][i] = r.top_p if filtered and r.top_p < 1 else 0.0
        any_filtered = any(r.filtered(vocab_size) for r in rows)
        for name, host in self._host.items():
            device = getattr(self, name)
            if device is not host:
                device[:n].copy_(host[:n], non_blocking=True)
        return any_filtered
