"""The sampler oracle: every step of ranks.sampler written out plainly on a full row.

The steps follow vLLM v1's order. Source read: vllm-project/vllm, vllm/v1/sample/sampler.py at
commit 3e342658b2e9c85a30a54d19e64e5ad77b8a26a6 (the ``Sampler`` class docstring lists the
same steps), with vllm/v1/sample/logits_processor/builtin.py (bf17660a), vllm/v1/sample/ops/
penalties.py (3ff2de9c), vllm/model_executor/layers/utils.py ``apply_penalties``,
csrc/sampler.cu ``apply_repetition_penalties_kernel`` and vllm/v1/sample/ops/
topk_topp_sampler.py (3babc05a). Model runner V2 (vllm/v1/worker/gpu/sample/sampler.py,
``Sampler.sample``) runs the same order.

0. Logprobs are computed from the raw logits before any step (``Sampler.forward``, logprobs
   mode ``raw_logprobs``); not part of this oracle.
1. FP32 copy (``Sampler.forward``: ``logits.to(torch.float32)``). NaN counts as -inf: our
   rule, vLLM has none.
2. allowed_token_ids: ``Sampler.apply_logits_processors`` masks every other id to -inf; then
   bad words (``apply_bad_words``, vllm/v1/sample/ops/bad_words.py): a word's last id to -inf
   where the output ends with the rest of it.
3. Non-argmax-invariant logits processors, in ``apply_logits_processors``: min_tokens
   (``MinTokensLogitsProcessor``: the stop ids to -inf while fewer than min_tokens tokens
   exist), then logit_bias (``LogitBiasLogitsProcessor.apply``: ``logits[rows, ids] += bias``).
4. Penalties (``Sampler.apply_penalties`` -> ``apply_all_penalties`` -> ``apply_penalties``):
   repetition over prompt and output ids (``logit / p`` if ``logit > 0`` else ``logit * p``,
   as the CUDA kernel writes it), then frequency (``-= f * output count``), then presence
   (``-= p`` for ids in the output).
5. Greedy rows (temperature < 1e-5): ``Sampler.sample`` -> ``greedy_sample``, the argmax of
   the row after step 4 (before temperature and filters); the first index, i.e. the smallest
   id, on ties.
6. Temperature (``Sampler.apply_temperature``: ``logits.div_(temp)``).
7. min-p, the argmax-invariant processor run in ``Sampler.sample`` after temperature
   (``MinPLogitsProcessor.apply``): drop ids whose softmax probability is below
   ``min_p * max probability``.
8. top-k, then top-p (``apply_top_k_top_p``): top-k drops values below the k-th largest
   (ties at the threshold stay); top-p takes the softmax of what steps 7 and top-k left and
   drops an id when the mass strictly above it is >= top_p (vLLM's ascending cumsum test
   ``probs_sum <= 1 - p``, written per value so that a tie at the boundary is kept whole;
   vLLM breaks such ties by sort order).
9. Random rows: vLLM's ``random_sample`` takes ``argmax(probs / q)``, q ~ Exp(1) from torch
   generators. Here: Gumbel-max, ``argmax(float64(y) + gumbel_noise(seed, position, id))``
   over the kept ids (smallest id on ties), with the counter-based Philox noise of
   kernels/noise/philox.py. Same distribution, different tokens (see docs/api.md, Sampling order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helios_logprobs.kernels.noise.philox import gumbel_noise
from helios_logprobs.ranks.sampler.params import RowSampling

NEG_INF = float("-inf")
BOUNDARY = 1e-9
"""Filter thresholds closer than this to a value are too close to call: the oracle refuses."""


def processed(
    logits: torch.Tensor, r: RowSampling, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """Steps 1-4 on one full row [vocab]: float32, before temperature."""
    x = logits.to(torch.float32).clone()
    x[torch.isnan(x)] = NEG_INF
    v = x.numel()
    if r.allowed_token_ids is not None:
        keep = torch.zeros(v, dtype=torch.bool)
        keep[list(r.allowed_token_ids)] = True
        x[~keep] = NEG_INF
    for word in r.bad_words:
        if len(word) == 1 or list(output[len(output) - len(word) + 1:]) == list(word[:-1]):
            x[word[-1]] = NEG_INF
    if r.position < r.min_tokens:
        x[list(r.min_tokens_ids)] = NEG_INF
    for token, bias in r.logit_bias:
        x[token] += torch.tensor(bias, dtype=torch.float32)
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.int64), minlength=v)
    if r.repetition_penalty != 1:
        seen = torch.zeros(v, dtype=torch.bool)
        seen[list(prompt) + list(output)] = True
        rep = torch.tensor(r.repetition_penalty, dtype=torch.float32)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if r.frequency_penalty != 0:
        freq = torch.tensor(r.frequency_penalty, dtype=torch.float32)
        x = torch.where(counts > 0, x - freq * counts, x)
    if r.presence_penalty != 0:
        x = torch.where(counts > 0, x - torch.tensor(r.presence_penalty, dtype=torch.float32), x)
    return x


def scaled(x: torch.Tensor, r: RowSampling) -> torch.Tensor:
    """Step 6 on a processed row (greedy rows are returned unscaled)."""
    return x if r.greedy else x / torch.tensor(r.temperature, dtype=torch.float32)


def kept(y: torch.Tensor, r: RowSampling) -> torch.Tensor:
    """Steps 7-8 on a temperature-scaled row: the bool mask of ids that stay candidates."""
    y = y.to(torch.float64)
    keep = torch.ones_like(y, dtype=torch.bool)
    if r.greedy:
        return keep
    if r.min_p > 0:
        probs = torch.softmax(y, 0)
        floor = probs.max() * r.min_p
        _check_boundary(probs[probs > 0], floor, "min_p")
        keep &= probs >= floor
    if 0 < r.top_k < y.numel():
        keep &= y >= torch.sort(y, descending=True).values[r.top_k - 1]
    if r.top_p < 1:
        z = torch.where(keep, y, NEG_INF)
        probs = torch.softmax(z, 0)
        values, group = torch.unique(z, return_inverse=True)
        mass = torch.zeros(values.numel(), dtype=torch.float64).scatter_add_(0, group, probs)
        above = (mass.flip(0).cumsum(0).flip(0) - mass)[group]
        _check_boundary(above[keep], r.top_p, "top_p")
        keep &= above < r.top_p
    return keep


def final(
    logits: torch.Tensor, r: RowSampling, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """What ShardedSampler.processed holds for the row: steps 1-8, dropped ids at -inf."""
    y = scaled(processed(logits, r, prompt, output), r)
    return y.masked_fill(~kept(y, r), NEG_INF)


def sample(
    logits: torch.Tensor, r: RowSampling, prompt: Sequence[int], output: Sequence[int]
) -> int:
    """The token of steps 1-9 (step 5 for greedy rows)."""
    y = final(logits, r, prompt, output).to(torch.float64)
    if not r.greedy:
        y = y + gumbel_noise(r.seed, r.position, torch.arange(y.numel(), dtype=torch.int64))
    return int(torch.argmax(y))


def _check_boundary(values: torch.Tensor, threshold: float | torch.Tensor, name: str) -> None:
    finite = values[torch.isfinite(values)]
    if finite.numel():
        gap = float((finite - threshold).abs().min())
        assert gap > BOUNDARY, f"{name}: a value lies {gap:.3g} from the threshold"
