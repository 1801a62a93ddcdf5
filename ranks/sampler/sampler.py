"""The sharded sampler: picks one token per logit row without gathering vocabulary rows.

Each rank holds ``logits[rows, local_width]`` for global ids ``vocab_start + lane``; lanes at
or beyond ``local_valid`` are padding and never sampled. Transformations, in vLLM v1's order
(vllm/v1/sample/sampler.py, ``Sampler.apply_logits_processors`` then ``Sampler.sample``; each
step is cited in tests/sampler_oracle.py and docs/api.md, "Sampling order"):
allowed_token_ids (grammar mask), bad_words and min_tokens (their ids masked), logit_bias,
repetition/frequency/presence penalties (ranks/sampler/processors.py); greedy rows take the
argmax here; then temperature, min-p, top-k, top-p (its mass is over what min-p
and top-k kept), and a Gumbel-max whose Philox noise is keyed by (seed, position, global id),
so a seeded row samples the same token at every TP degree. The raw logits are never
modified: all work happens in a scratch buffer, which ``processed`` exposes for target
verification. NaN logits count as -inf. Greedy rows without processors are picked by a
compiled argmax of the raw rows (kernels/greedy: the same rule, no scratch copy); rows that are
temperature-only (no processor, no filter) are searched by compiled code in the raw rows,
divided as the scratch would hold them (ranks/sampler/gumbel.py, scaled_gumbel_best: the same
token); only the other rows reach the scratch.

Exchanges (all fixed-width int32 all-gathers, skipped for a size-1 group):
- greedy and temperature-only rows: only the final pick, 3 words per row.
- rows with top-k <= 256, top-p or min-p: one 256-word exchange of each shard's best values
  (global max, k-th largest value).
- top-k > 256 and top-p: a 5-round radix select over bucket sums (256 words per round); the
  vocabulary row is never gathered.
Tie rules are documented in ranks/sampler/filters.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.kernels.greedy import native as greedy_native
from helios_logprobs.kernels.greedy.native import native_argmax
from helios_logprobs.kernels.noise import philox_native
from helios_logprobs.kernels.noise.philox_native import native_scaled_rows
from helios_logprobs.ranks.sampler import ops as sample_ops
from helios_logprobs.ranks.sampler.buffers import PlanBuffers
from helios_logprobs.ranks.sampler.filters import (
    FILTER_WORDS,
    PICK_WORDS,
    first_argmax,
    greedy_best,
    key_values,
    max_and_topk,
    pick_global,
    radix_lanes,
    radix_thresholds,
    remove_below_kth,
    remove_below_min_p,
    score_keys,
)
from helios_logprobs.ranks.sampler.gumbel import exact_gumbel_best, gumbel_best, scaled_gumbel_best
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.plan import (
    FilterPlan,
    FilterRows,
    PlanShape,
    SamplePlan,
    ScratchPlan,
)
from helios_logprobs.ranks.sampler.processors import NEG_INF, ShardLanes


class ShardedSampler:
    def __init__(
        self,
        group: object | None,
        vocab_start: int,
        local_valid: int,
        local_width: int,
        vocab_size: int,
        max_rows: int,
        device: torch.device | str = "cpu",
        capture_safe: bool | None = None,
    ) -> None:
        if vocab_size < 1 or max_rows < 1:
            raise ValueError(f"vocab_size and max_rows must be >= 1, got {vocab_size}, {max_rows}")
        if not 0 <= local_valid <= local_width:
            raise ValueError(f"local_valid {local_valid} outside [0, local_width={local_width}]")
        if vocab_start < 0 or vocab_start + local_valid > vocab_size:
            raise ValueError(
                f"shard [{vocab_start}, {vocab_start + local_valid}) outside vocab {vocab_size}"
            )
        self.group = group
        self.vocab_start = vocab_start
        self.local_valid = local_valid
        self.local_width = local_width
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.capture_safe = self.device.type == "cuda" if capture_safe is None else capture_safe
        """Sample with fixed shapes and no host read (every lane's noise drawn, dense radix
        rounds, no compiled CPU search, launches as custom ops: ranks/sampler/ops.py): what a
        captured or compiled step runs. The CUDA default; on the CPU the compiled pruning
        searches are 2-220x faster and pick the same tokens (docs/performance.md), so the CPU
        takes it only where the step asks (processed modes, --compile)."""
        self.lanes = ShardLanes(vocab_start, local_valid, vocab_size, self.device)
        self.lane_ids = torch.arange(vocab_start, vocab_start + local_width,
                                     dtype=torch.int64, device=self.device)
        """Each lane's global id (the capture-safe Gumbel-max keys its noise with them)."""
        self.scratch = torch.empty(max_rows, local_width, dtype=torch.float32, device=self.device)
        self.buffers = PlanBuffers(max_rows, local_valid, self.device)
        """The plan's static storage (ranks/sampler/buffers.py): prepare allocates nothing."""
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        """The capture-safe path's output: run returns a view of it (valid until the next)."""
        self.best = torch.zeros(2, max_rows, dtype=torch.int64, device=self.device)
        """The capture-safe path's per-row best (score key, global id) on this shard."""
        self.filter_exchange = WordExchange(group, max_rows, FILTER_WORDS, self.device)
        self.pick_exchange = WordExchange(group, max_rows, PICK_WORDS, self.device)
        if self.device.type == "cpu":  # compiled (or found in their cache) now, not mid-serving
            philox_native.available()
            greedy_native.available()

    def plan(self, rows: Sequence[RowSampling], prompt_ids: Sequence[Sequence[int]],
             output_ids: Sequence[Sequence[int]]) -> SamplePlan:
        """Every host decision of sampling ``rows`` (ranks/sampler/plan.py): the step's prepare
        phase makes it, so that ``run`` only applies tensors."""
        shape = PlanShape(self.lanes, self.max_rows, self.pick_exchange.world,
                          not self.capture_safe, self.buffers)
        return SamplePlan(shape, rows, prompt_ids, output_ids)

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Global token ids int64 [rows], identical on every rank of the group (a tensor of
        its own)."""
        tokens = self.run(logits, self.plan(rows, prompt_ids, output_ids))
        return tokens.clone() if self.capture_safe else tokens

    def run(self, logits: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
        """``sample`` of a plan made before the logits (int64 [rows], on every rank). The
        capture-safe path writes them into ``self.tokens`` (a fixed address) and returns that
        view, valid until the next run."""
        tokens = self._run(logits, plan)
        if not self.capture_safe:
            return tokens
        out = self.tokens[: plan.n]
        sample_ops.sample_pick(tokens, out)
        return out

    def _run(self, logits: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
        self._check(logits, plan.n)
        n = plan.n
        if plan.greedy_only:
            lane = self._raw_argmax(logits, None)
            if lane is not None:  # (one rank: its argmax is the pick)
                return lane + self.vocab_start
        found = [(plan.plain_greedy, self._plain_greedy(logits, plan)),
                 (plan.plain, self._plain_temperature(logits, plan))]
        parts = [(which, best) for which, best in found if which and best is not None]
        taken = {i for which, _ in parts for i in which}
        rest = [i for i in range(n) if i not in taken]
        if rest:
            scratch = plan.scratch(rest, bool(taken))
            x = self._transform(logits, scratch, plan.native)
            if self.pick_exchange.world == 1 and not taken and plan.all_greedy:
                return first_argmax(x) + self.vocab_start
            parts.append((rest, self._scratch_best(x, scratch, plan.native)))
        return pick_global(*self._in_row_order(parts, plan), self.pick_exchange)

    def _in_row_order(self, parts: list[tuple[list[int], tuple[torch.Tensor, torch.Tensor]]],
                      plan: SamplePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, ids) [n] from parts that each found the rows they name."""
        if len(parts) == 1:  # (it names every row, in order)
            return parts[0][1]
        merged = torch.empty(2, plan.n, dtype=torch.int64, device=self.device)
        for which, best in parts:
            merged[:, plan.index(which)] = torch.stack(best)
        return merged[0], merged[1]

    def _scratch_best(self, x: torch.Tensor, plan: ScratchPlan, native: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's best (score key, global id) of each scratch row: the argmax of greedy
        rows, the Gumbel-max of the others."""
        if not native and plan.dense is not None:  # (the capture-safe path: one launch)
            keys, ids = self.best[0, : plan.n], self.best[1, : plan.n]
            dense = plan.dense
            sample_ops.sample_best(x, dense.greedy, dense.seeds, dense.positions,
                                   self.lane_ids[: self.local_valid], self.vocab_start, keys,
                                   ids)
            return keys, ids
        if plan.seeded is None:
            return greedy_best(x, self.vocab_start)
        if plan.greedy is None:  # (every row: no copy of x)
            return self._gumbel(x, plan.seeds, plan.positions, native)
        keys = torch.empty(plan.n, dtype=torch.int64, device=self.device)
        ids = torch.empty_like(keys)
        picked, drawn = plan.greedy, plan.seeded
        keys[picked], ids[picked] = greedy_best(x[picked], self.vocab_start)
        keys[drawn], ids[drawn] = self._gumbel(x[drawn], plan.seeds, plan.positions, native)
        return keys, ids

    def _gumbel(self, x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if native:
            return gumbel_best(x, seeds, positions, self.vocab_start)
        return exact_gumbel_best(x, seeds, positions, self.lane_ids[: self.local_valid])

    def processed(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The scratch rows [rows, local_valid] after every transformation (filtered lanes are
        -inf; greedy rows are neither scaled nor filtered). A view of the scratch buffer,
        valid until the next call. Collective: every rank of the group must call it."""
        plan = self.plan(rows, prompt_ids, output_ids)
        self._check(logits, plan.n)
        return self._transform(logits, plan.scratch(range(plan.n), False), plan.native)

    def _raw_argmax(self, logits: torch.Tensor, which: torch.Tensor | None
                    ) -> torch.Tensor | None:
        """The compiled argmax lane of raw rows `which` (default all; NaN as -inf, as in the
        scratch), or None where it does not apply (the scratch path)."""
        if not self.local_valid:
            return None
        return native_argmax(logits[:, : self.local_valid], which, checked=True)

    def _plain_greedy(self, logits: torch.Tensor, plan: SamplePlan
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This shard's best (score key, global id) of the unprocessed greedy rows, read from
        the raw rows with no scratch copy; None where it does not apply. A shard's best
        score is its raw value, widened as the scratch widens it."""
        if not plan.plain_greedy:
            return None
        which = plan.index(plan.plain_greedy)
        lane = self._raw_argmax(logits, which)
        if lane is None:
            return None
        score = logits[which, lane].to(torch.float64)
        score = torch.where(score.isnan(), NEG_INF, score)
        return score_keys(score), lane + self.vocab_start

    def _plain_temperature(self, logits: torch.Tensor, plan: SamplePlan
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This shard's best (score key, global id) of the temperature-only rows (no logits
        processor, no filter): compiled code reads their raw rows, as the scratch would hold
        them after the copy and the division, and finds the few lanes that can still win;
        no scratch copy. None where it does not apply (the scratch path)."""
        if not plan.plain:
            return None
        return scaled_gumbel_best(logits[:, : self.local_valid], plan.plain,
                                  plan.plain_temperatures, plan.plain_seeds,
                                  plan.plain_positions, self.vocab_start)

    def _check(self, logits: torch.Tensor, n: int) -> None:
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] != self.local_width:
            raise ValueError(
                f"logits: expected [{n}, {self.local_width}], got {tuple(logits.shape)}"
            )

    def _transform(self, logits: torch.Tensor, plan: ScratchPlan, native: bool
                   ) -> torch.Tensor:
        """The scratch rows of the plan's rows (the rows ``plan.which`` of logits, default
        all of them)."""
        x = self.scratch[: plan.n, : self.local_valid]
        source = logits[:, : self.local_valid]
        if plan.which is not None:
            source = source.index_select(0, plan.which)
        # No processor in the batch: the copy, the NaN rule and the division in one pass.
        if not native:  # (capture-safe: the copy as one launch, processors, the division)
            processed = bool(plan.processors.masks or plan.processors.penalties)
            sample_ops.sample_scale(source, plan.scale, not processed, x)
            if processed:
                plan.processors.apply(x)
                if plan.scaled:
                    x.div_(plan.scale.unsqueeze(1))
        elif not (native and plan.unprocessed and native_scaled_rows(source, plan.scale, x)):
            if source.dtype == x.dtype:  # (the copy and the NaN rule in one pass)
                torch.nan_to_num(source, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF,
                                 out=x)
            else:
                x.copy_(source).nan_to_num_(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
            plan.processors.apply(x)
            if plan.scaled:
                x.div_(plan.scale.unsqueeze(1))
        if plan.filters is not None:
            self._filter(x, plan.filters, native)
        return x

    def _filter(self, x: torch.Tensor, plan: FilterPlan, native: bool) -> None:
        block = x if plan.index is None else x[plan.index]
        max_key, kth = max_and_topk(block, plan.ks, self.filter_exchange, plan.take, native)
        maxima = key_values(max_key)

        def row_max(rows: FilterRows) -> torch.Tensor:
            return maxima if rows.maxima is None else maxima.index_select(0, rows.maxima)

        # min-p first, as vLLM runs it (before top-k and top-p). It keeps exp(x - max) >=
        # min_p, and the max survives every filter, so its set does not depend on where it
        # runs; but top-p below then measures mass over what min-p kept.
        if plan.min_p is not None:
            rows = plan.min_p
            self._change(x, rows.index, lambda b: remove_below_min_p(
                b, row_max(rows), rows.values, native))
        # The k-th largest values were exchanged before min-p; that is the same cut, because
        # min-p only drops values below every value it keeps.
        if plan.small is not None:
            self._change(x, plan.index, lambda b: remove_below_kth(b, kth, plan.small, native))

        def radix_cut(rows: FilterRows, block: torch.Tensor, top_p: bool) -> None:
            lanes = radix_lanes(block, row_max(rows) if top_p else None, self.vocab_size,
                                native)
            cut = radix_thresholds(lanes, rows.values, top_p, self.filter_exchange)
            lanes.remove_below(block, cut)

        if plan.large is not None:
            large = plan.large
            self._change(x, large.index, lambda b: radix_cut(large, b, False))
        if plan.top_p is not None:
            # Lanes already at -inf (min-p, top-k) weigh 0: top-p's mass is over the rest.
            top_p = plan.top_p
            self._change(x, top_p.index, lambda b: radix_cut(top_p, b, True))

    @staticmethod
    def _change(x: torch.Tensor, index: torch.Tensor | None,
                change: Callable[[torch.Tensor], object]) -> None:
        """``change(rows block)`` in place on rows ``index`` of x (None: every row)."""
        if index is None:
            change(x)
        else:
            block = x[index]
            change(block)
            x[index] = block

