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

from collections.abc import Callable, Iterable, Sequence

import torch

from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.kernels.greedy import native as greedy_native
from helios_logprobs.kernels.greedy.native import native_argmax
from helios_logprobs.kernels.noise import philox_native
from helios_logprobs.kernels.noise.philox_native import native_scaled_rows
from helios_logprobs.ranks.sampler.filters import (
    FILTER_WORDS,
    PICK_WORDS,
    TOPK_WIDTH,
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
from helios_logprobs.ranks.sampler.gumbel import gumbel_best, scaled_gumbel_best
from helios_logprobs.ranks.sampler.params import SEED_MAX, RowSampling
from helios_logprobs.ranks.sampler.processors import (
    FLOAT32_MAX,
    NEG_INF,
    ShardLanes,
    apply_processors,
)


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
        self.lanes = ShardLanes(vocab_start, local_valid, vocab_size, self.device)
        self.scratch = torch.empty(max_rows, local_width, dtype=torch.float32, device=self.device)
        self.filter_exchange = WordExchange(group, max_rows, FILTER_WORDS, self.device)
        self.pick_exchange = WordExchange(group, max_rows, PICK_WORDS, self.device)
        if self.device.type == "cpu":  # compiled (or found in their cache) now, not mid-serving
            philox_native.available()
            greedy_native.available()

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Global token ids int64 [rows], identical on every rank of the group."""
        self._check(logits, rows, prompt_ids, output_ids)
        n = len(rows)
        plain_greedy = [i for i, r in enumerate(rows) if r.greedy and r.unprocessed]
        if len(plain_greedy) == n and self.pick_exchange.world == 1:
            lane = self._raw_argmax(logits, None)
            if lane is not None:  # (one rank: its argmax is the pick)
                return lane + self.vocab_start
        plain = [i for i, r in enumerate(rows)
                 if not r.greedy and r.unprocessed and not r.filtered(self.vocab_size)]
        found = [(plain_greedy, self._plain_greedy(logits, plain_greedy)),
                 (plain, self._plain_temperature(logits, rows, plain))]
        parts = [(which, best) for which, best in found if which and best is not None]
        taken = {i for which, _ in parts for i in which}
        rest = [i for i in range(n) if i not in taken]
        if rest:
            rest_rows = [rows[i] for i in rest]
            x = self._transform(logits, rest_rows, [prompt_ids[i] for i in rest],
                                [output_ids[i] for i in rest],
                                self._index(rest) if taken else None)
            if self.pick_exchange.world == 1 and not taken and all(r.greedy for r in rows):
                return first_argmax(x) + self.vocab_start
            parts.append((rest, self._scratch_best(x, rest_rows)))
        return pick_global(*self._in_row_order(parts, n), self.pick_exchange)

    def _in_row_order(self, parts: list[tuple[list[int], tuple[torch.Tensor, torch.Tensor]]],
                      n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, ids) [n] from parts that each found the rows they name."""
        if len(parts) == 1:  # (it names every row, in order)
            return parts[0][1]
        merged = torch.empty(2, n, dtype=torch.int64, device=self.device)
        for which, best in parts:
            merged[:, self._index(which)] = torch.stack(best)
        return merged[0], merged[1]

    def _scratch_best(self, x: torch.Tensor, rows: Sequence[RowSampling]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's best (score key, global id) of each scratch row: the argmax of greedy
        rows, the Gumbel-max of the others."""
        greedy = [i for i, r in enumerate(rows) if r.greedy]
        seeded = [i for i, r in enumerate(rows) if not r.greedy]
        if not seeded:
            return greedy_best(x, self.vocab_start)
        seeds = self._index(_signed_seed(rows[i].seed) for i in seeded)
        positions = self._index(rows[i].position for i in seeded)
        if not greedy:  # (every row: no copy of x)
            return gumbel_best(x, seeds, positions, self.vocab_start)
        keys = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        ids = torch.empty_like(keys)
        picked, drawn = self._index(greedy), self._index(seeded)
        keys[picked], ids[picked] = greedy_best(x[picked], self.vocab_start)
        keys[drawn], ids[drawn] = gumbel_best(x[drawn], seeds, positions, self.vocab_start)
        return keys, ids

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
        self._check(logits, rows, prompt_ids, output_ids)
        return self._transform(logits, rows, prompt_ids, output_ids)

    def _raw_argmax(self, logits: torch.Tensor, which: list[int] | None) -> torch.Tensor | None:
        """The compiled argmax lane of raw rows `which` (default all; NaN as -inf, as in the
        scratch), or None where it does not apply (the scratch path)."""
        if not self.local_valid:
            return None
        index = None if which is None else self._index(which)
        return native_argmax(logits[:, : self.local_valid], index)

    def _plain_greedy(self, logits: torch.Tensor, which: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This shard's best (score key, global id) of the unprocessed greedy rows `which`, read
        from the raw rows with no scratch copy; None where it does not apply. A shard's best
        score is its raw value, widened as the scratch widens it."""
        lane = self._raw_argmax(logits, which) if which else None
        if lane is None:
            return None
        score = logits[self._index(which), lane].to(torch.float64)
        score = torch.where(score.isnan(), NEG_INF, score)
        return score_keys(score), lane + self.vocab_start

    def _plain_temperature(self, logits: torch.Tensor, rows: Sequence[RowSampling],
                           plain: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This shard's best (score key, global id) of the temperature-only rows `plain` (no
        logits processor, no filter): compiled code reads their raw rows, as the scratch
        would hold them after the copy and the division, and finds the few lanes that can
        still win; no scratch copy. None where it does not apply (the scratch path)."""
        if not plain:
            return None
        temps = torch.tensor([rows[i].temperature for i in plain], dtype=torch.float32)
        return scaled_gumbel_best(logits[:, : self.local_valid], plain,
                                  temps.clamp_(max=FLOAT32_MAX),
                                  [_signed_seed(rows[i].seed) for i in plain],
                                  [rows[i].position for i in plain], self.vocab_start)

    def _check(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> None:
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] != self.local_width:
            raise ValueError(
                f"logits: expected [{n}, {self.local_width}], got {tuple(logits.shape)}"
            )
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"rows: expected 1..{self.max_rows}, got {n}")
        if len(prompt_ids) != n or len(output_ids) != n:
            raise ValueError(f"prompt_ids and output_ids: expected {n} lists each")
        for i, r in enumerate(rows):
            if r.max_token_id() >= self.vocab_size:
                raise ValueError(f"rows[{i}]: token id {r.max_token_id()} outside vocabulary")

    def _transform(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        which: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scratch rows of `rows` (the rows `which` of logits; default all of them)."""
        n = len(rows)
        x = self.scratch[:n, : self.local_valid]
        source = logits[:, : self.local_valid]
        if which is not None:
            source = source.index_select(0, which)
        temps = [1.0 if r.greedy else r.temperature for r in rows]
        scale = torch.tensor(temps, dtype=torch.float32, device=self.device)
        scale.clamp_(max=FLOAT32_MAX)  # (+inf / +inf would be NaN)
        # No processor in the batch: the copy, the NaN rule and the division in one pass.
        if not (all(r.unprocessed for r in rows) and native_scaled_rows(source, scale, x)):
            if source.dtype == x.dtype:  # (the copy and the NaN rule in one pass)
                torch.nan_to_num(source, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF,
                                 out=x)
            else:
                x.copy_(source).nan_to_num_(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
            apply_processors(x, rows, prompt_ids, output_ids, self.lanes)
            if any(t != 1.0 for t in temps):
                x.div_(scale.unsqueeze(1))
        self._filter(x, rows)
        return x

    def _filter(self, x: torch.Tensor, rows: Sequence[RowSampling]) -> None:
        v = self.vocab_size
        filtered = [i for i, r in enumerate(rows) if r.filtered(v)]
        if not filtered:
            return
        small = [rows[i].top_k_active(v) and rows[i].top_k <= TOPK_WIDTH for i in filtered]
        ks = [rows[i].top_k if s else 1 for i, s in zip(filtered, small, strict=True)]
        block = x if len(filtered) == x.shape[0] else x[self._index(filtered)]
        max_key, kth = max_and_topk(block, self._index(ks), self.filter_exchange)
        maxima = dict(zip(filtered, key_values(max_key).unbind(0), strict=True))

        def row_max(which: list[int]) -> torch.Tensor:
            return torch.stack([maxima[i] for i in which])

        # min-p first, as vLLM runs it (before top-k and top-p). It keeps exp(x - max) >=
        # min_p, and the max survives every filter, so its set does not depend on where it
        # runs; but top-p below then measures mass over what min-p kept.
        min_p = [i for i in filtered if rows[i].min_p > 0]
        if min_p:
            floors = self._float64([rows[i].min_p for i in min_p])
            self._change(x, min_p, lambda b: remove_below_min_p(b, row_max(min_p), floors))
        # The k-th largest values were exchanged before min-p; that is the same cut, because
        # min-p only drops values below every value it keeps.
        if any(small):
            small_rows = torch.tensor(small, device=self.device)
            self._change(x, filtered, lambda b: remove_below_kth(b, kth, small_rows))

        def radix_cut(which: list[int], block: torch.Tensor, top_p: bool) -> None:
            lanes = radix_lanes(block, row_max(which) if top_p else None, v)
            targets = self._float64([rows[i].top_p if top_p else rows[i].top_k for i in which])
            cut = radix_thresholds(lanes, targets, top_p, self.filter_exchange)
            lanes.remove_below(block, cut)

        large = [i for i in filtered if rows[i].top_k_active(v) and rows[i].top_k > TOPK_WIDTH]
        if large:
            self._change(x, large, lambda b: radix_cut(large, b, False))
        top_p = [i for i in filtered if rows[i].top_p < 1]
        if top_p:
            # Lanes already at -inf (min-p, top-k) weigh 0: top-p's mass is over the rest.
            self._change(x, top_p, lambda b: radix_cut(top_p, b, True))

    def _change(
        self, x: torch.Tensor, which: list[int], change: Callable[[torch.Tensor], object]
    ) -> None:
        """``change(rows block)`` in place on rows ``which`` of x."""
        if len(which) == x.shape[0]:
            change(x)
        else:
            idx = self._index(which)
            block = x[idx]
            change(block)
            x[idx] = block

    def _index(self, values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def _float64(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor([float(t) for t in values], dtype=torch.float64, device=self.device)


def _signed_seed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 the Philox keys are read from."""
    return seed - SEED_MAX if seed >= 2**63 else seed

