"""Processed logprobs and entropy as the rank step composes them, on one shard of a case.

``run_modes`` samples the rows with the capture-safe sharded sampler (what RankStep builds
under a processed ``--logprobs-mode``: every row through the scratch), then reduces the
scratch (processed modes) or the raw rows (raw modes) with the six-launch driver, with
entropy, as ranks/step/reduce.py does. ``check_modes`` compares every rank's payload with the
oracle of tests/sampler_oracle.py (vLLM's processor order on the full row) renormalized in
float64 (tests/oracles.py check_row), and the entropy with the float64 entropy.
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import LOGPROBS_MODES, MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sharded import PreparedShardedReduction
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
from tests import sampler_oracle as oracle
from tests.entropy_cases import PAD_VALUE, TOLERANCE, reference_entropy
from tests.oracles import check_row

VOCAB = 301
K = 20
NEG_INF = float("-inf")


def scenario(base: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, list[RowSampling], list[list[int]], list[list[int]]]:
    """Greedy and sampled rows: temperatures, top-k (small, tied at the cut-off, radix),
    top-p (tied at the cut-off), min-p, their combinations, penalties, logit_bias, a grammar
    mask and a row whose kept set is smaller than K. ``base``: FP32 [14, VOCAB] rows to use
    instead of the random ones (transformers' logits), with the same ties planted."""
    gen = torch.Generator().manual_seed(381)
    params = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.3, logit_bias={17: 2.0}),
        dict(temperature=0.7),
        dict(temperature=1.6, seed=2**64 - 5),
        dict(top_k=5),
        dict(top_k=3, temperature=2.0),  # four values tie at the cut-off: all four stay
        dict(top_k=280, temperature=0.9),
        dict(top_p=0.9),
        dict(top_p=0.5, temperature=3.0),  # a tie at the boundary is kept whole
        dict(min_p=0.1, temperature=1.5),
        dict(top_k=50, top_p=0.8, min_p=0.05, temperature=0.7),
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
             logit_bias={300: 3.0, 0: -2.0, 151: 1.0}),
        dict(allowed_token_ids=(3, 150, 151, 225, 300), top_p=0.9, temperature=4.0),
        dict(top_k=290, top_p=0.3, seed=-(2**40)),
    ]
    rows = [RowSampling(**({"seed": 7 * i + 1, "position": 3} | p))
            for i, p in enumerate(params)]
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    if base is not None:
        logits = base.to(torch.float32).clone()
    logits[5, [10, 160, 230, 299]] = 12.0
    logits[8, [70, 151, 152, 300]] = 6.0
    logits[11] = logits[11].round()
    prompt = [[(13 * i + 7 * j) % VOCAB for j in range(6)] for i in range(len(rows))]
    output = [[(29 * i + 151 * j) % VOCAB for j in range(5)] for i in range(len(rows))]
    return logits, rows, prompt, output


def shard(world: int, rank: int) -> tuple[int, int, int]:
    width = -(-VOCAB // world)
    start = rank * width
    return start, width, max(0, min(width, VOCAB - start))


def run_modes(group: object, world: int, rank: int, base: torch.Tensor | None = None) -> dict:
    """On one rank: {mode: (payload int32 [rows, 258], entropy FP32 [rows])} and the tokens."""
    full, rows, prompt, output = scenario(base)
    start, width, valid = shard(world, rank)
    n = len(rows)
    sampler = ShardedSampler(group, start, valid, width, VOCAB, max_rows=n, capture_safe=True)
    local = torch.full((n, width), PAD_VALUE)
    local[:, :valid] = full[:, start : start + valid]
    tokens = sampler.sample(local, rows, prompt, output)
    processed = sampler.scratch  # [n, width]: the rows after every transformation
    request = RowRequest(tokens, torch.full((n, MAX_TOKEN_IDS), -1, dtype=torch.int32),
                         torch.zeros(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32), K)
    result = {"tokens": tokens}
    for mode in LOGPROBS_MODES:
        driver = PreparedShardedReduction(group, n, width, start, valid, VOCAB, "torch", "cpu",
                                          normalize=mode.endswith("_logprobs"))
        source = processed if mode.startswith("processed_") else local
        out = torch.full((n, PAYLOAD_WORDS), -1, dtype=torch.int32)
        entropy = torch.full((n,), float("nan"))
        driver(source, request, out, entropy_out=entropy)
        result[mode] = (out, entropy)
    return result


def reported_rows(mode: str, base: torch.Tensor | None = None) -> torch.Tensor:
    """The full rows whose values (or renormalized values) each mode reports: vLLM's."""
    full, rows, prompt, output = scenario(base)
    if mode.startswith("raw_"):
        return full
    return torch.stack([oracle.final(full[i], r, prompt[i], output[i])
                        for i, r in enumerate(rows)])


def check_modes(result: dict, base: torch.Tensor | None = None) -> None:
    full, rows, prompt, output = scenario(base)
    tokens = result["tokens"].tolist()
    for i, r in enumerate(rows):
        assert tokens[i] == oracle.sample(full[i], r, prompt[i], output[i]), i
    for mode in LOGPROBS_MODES:
        out, entropy = result[mode]
        x = reported_rows(mode, base)
        want_entropy = reference_entropy(x)
        for i in range(len(rows)):
            if mode.endswith("_logprobs"):
                check_row(out[i], x[i], VOCAB, tokens[i], K, [])
            else:
                check_values(out[i], x[i], tokens[i])
            assert abs(float(entropy[i]) - float(want_entropy[i])) <= TOLERANCE, (mode, i)


def check_values(words: torch.Tensor, x: torch.Tensor, chosen: int) -> None:
    """*_logits: the row's own FP32 values bit for bit, in (value desc, id asc) order."""
    ids = words[0::2].tolist()
    values = words[1::2].view(torch.float32)
    assert ids[0] == chosen and values[0] == x[chosen]
    order = sorted(range(VOCAB), key=lambda j: (-float(x[j]), j))[:K]
    assert ids[1 : 1 + K] == order, (ids[1 : 1 + K], order)
    assert torch.equal(values[1 : 1 + K], x[order])


def kept_counts() -> list[int]:
    """Tokens each row keeps under the processed modes (the scenario is not trivial)."""
    x = reported_rows("processed_logprobs")
    return [int((row > NEG_INF).sum()) for row in x]


def processed_logprob(i: int) -> float:
    """Float64 processed logprob of row i's sampled token (the oracle's pick)."""
    full, rows, prompt, output = scenario()
    y = oracle.final(full[i], rows[i], prompt[i], output[i]).to(torch.float64)
    token = oracle.sample(full[i], rows[i], prompt[i], output[i])
    return float(y[token] - torch.logsumexp(y, 0))



def transformers_rows(model_dir) -> torch.Tensor:
    """FP32 [14, VOCAB]: transformers' logits of a checkpoint with VOCAB lanes
    (tests/checkpoints.py write_qwen2) at the 14 positions of a fixed prompt (``base``)."""
    from tests.checkpoints import _hf_model

    prompt = [(37 * j + 11) % VOCAB for j in range(len(scenario()[1]))]
    with torch.no_grad():
        return _hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float()
