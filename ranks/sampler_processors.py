"""The sampler's logits processors, on a shard's scratch rows, in vLLM v1's order: allowed ids
(grammar mask), the blocked ids of min_tokens and bad_words, logit_bias, then the repetition,
frequency and presence penalties (vllm/v1/sample/sampler.py; ranks/sampler.py runs them after
the scratch copy and before the temperature and the filters).

Every factor and term is a finite float32 and finite lanes saturate at +-LOGIT_LIMIT, so no
lane becomes NaN or +-inf: the only -inf lanes are masked ones, and every row keeps a lane to
pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ranks.sampling_params import GREEDY_EPS, RowSampling

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

    def local(self, token_ids: Sequence[int], values: Sequence[float] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Lanes of this shard among global ids (and the matching float32 values)."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids outside vocabulary [0, {self.vocab_size})")
        lanes = ids - self.vocab_start
        mine = (lanes >= 0) & (lanes < self.local_valid)
        if values is None:
            return lanes[mine], None
        vals = torch.tensor(list(values), dtype=torch.float32, device=self.device)
        return lanes[mine], vals[mine]


def apply_processors(x: torch.Tensor, rows: Sequence[RowSampling],
                     prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                     shard: ShardLanes) -> None:
    """Each row's processors on its scratch row x[i] (float32 [local_valid]), in place."""
    for i, r in enumerate(rows):
        if r.allowed_token_ids is not None:
            lanes, _ = shard.local(r.allowed_token_ids)
            blocked = torch.ones(shard.local_valid, dtype=torch.bool, device=shard.device)
            blocked[lanes] = False
            x[i].masked_fill_(blocked, NEG_INF)
        masked = list(r.blocked_ids)
        if r.bad_words:
            masked += r.banned_ids(output_ids[i])
        if masked:
            lanes, _ = shard.local(masked)
            x[i].index_fill_(0, lanes, NEG_INF)
        if r.logit_bias:
            lanes, bias = shard.local([t for t, _ in r.logit_bias], [b for _, b in r.logit_bias])
            old = x[i, lanes]
            x[i, lanes] = saturated(old + bias.clamp_(-FLOAT32_MAX, FLOAT32_MAX), old)
        # After logit_bias, as in vLLM: the repetition penalty scales the biased logit.
        if r.penalized:
            _penalize(x[i], r, prompt_ids[i], output_ids[i], shard)


def _penalize(row: torch.Tensor, r: RowSampling, prompt: Sequence[int], output: Sequence[int],
              shard: ShardLanes) -> None:
    out_lanes, _ = shard.local(output)
    lanes, counts = torch.unique(out_lanes, return_counts=True)
    # Every factor and term is a positive / finite float32, so no lane becomes NaN: a
    # penalty that rounds to 0 or inf in float32 would turn a masked lane's -inf (times
    # 0) or a zero logit (times inf) into NaN, which no pick can rank.
    if r.repetition_penalty != 1:
        prompt_lanes, _ = shard.local(prompt)
        seen = torch.unique(torch.cat((prompt_lanes, lanes)))
        vals = row[seen]
        rep = _float32(r.repetition_penalty, shard).clamp_(FLOAT32_TINY, FLOAT32_MAX)
        row[seen] = saturated(torch.where(vals > 0, vals / rep, vals * rep), vals)
    if r.frequency_penalty != 0:
        freq = _float32(r.frequency_penalty, shard).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        old = row[lanes]
        term = (freq * counts.to(torch.float32)).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        row[lanes] = saturated(old - term, old)
    if r.presence_penalty != 0:
        old = row[lanes]
        pres = _float32(r.presence_penalty, shard).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        row[lanes] = saturated(old - pres, old)


def _float32(value: float, shard: ShardLanes) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=shard.device)


def saturated(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` with the lanes that were finite in ``old`` kept within +-LOGIT_LIMIT: a finite
    logit that a penalty or bias pushes past float32's range (or past what a temperature can
    divide) stays the most extreme finite value instead of becoming +-inf. Values within the
    limit, and lanes that were already infinite, are unchanged."""
    return torch.where(old.isfinite(), new.clamp(-LOGIT_LIMIT, LOGIT_LIMIT), new)
