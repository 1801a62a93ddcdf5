"""The sample phase, capture-safe (issue 36): with the sampler's host decisions made in
prepare (ShardedSampler.plan), the capture-safe sampler (CUDA's path: every lane's noise
drawn, dense radix rounds, no compiled CPU search) runs real serving steps with every sampler
feature the engine serves under a strict guard: no host read of a tensor, no tensor built
from host data, no value-sized output (tests/capture_guard.py). Its tokens equal the CPU's
compiled sampler's and the independent oracle's (tests/sampler_oracle.py), bit for bit, and
so do the scratch rows it filters."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.sampler import sampler as sampler_module
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
from helios_logprobs.runtime.engine.client import SamplingParams
from tests import sampler_oracle as oracle
from tests.capture_guard import HostSync, HostSyncGuard
from tests.checkpoints import write_qwen2
from tests.unit.ranks.test_capture_safe_step import PlanLog, engine_for
from tests.unit.ranks.test_sampler import FILTER_ROWS, ORDER_ROWS

FEATURES = [
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=20),
    SamplingParams(max_tokens=9, temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs=3),
    SamplingParams(max_tokens=9, temperature=1.2, top_k=280, seed=7),
    SamplingParams(max_tokens=9, temperature=1.0, top_p=0.6, min_p=0.05, seed=11,
                   logprob_token_ids=(300, 0, 7)),
    SamplingParams(max_tokens=9, temperature=0.9, repetition_penalty=1.3,
                   frequency_penalty=0.4, presence_penalty=0.2, seed=13, logprobs=1),
    SamplingParams(max_tokens=9, temperature=0.0, logit_bias=((5, 2.0), (9, -1.0)),
                   bad_words=((7, 8),), repetition_penalty=1.2),
    SamplingParams(max_tokens=9, temperature=0.7, min_tokens=4, stop_token_ids=(4, 6), seed=17),
    SamplingParams(max_tokens=9, temperature=1.0, allowed_token_ids=tuple(range(0, 300, 3)),
                   seed=19, logprobs=0),
    SamplingParams(max_tokens=9, temperature=0.5, seed=2**64 - 5, top_k=40, min_p=0.1),
]
"""Greedy, seeded temperature, top-k (exchanged and radix), top-p, min-p, the three
penalties, logit_bias, bad_words, min_tokens, allowed ids, a seed past 2**63; logprobs on and
off, selected ids."""
PROMPTS = [[5, 6, 7, 8] * 3, [3, 9, 27, 81, 3, 9], [11, 12, 11, 12, 11], [40, 41, 40, 41],
           [7, 7, 7, 7], [9, 8, 9, 8, 9], [2, 4, 6, 2, 4, 6], [13, 14, 13], [21, 22, 21, 22]]
JOBS = [(p, SamplingParams(**{**vars(s), "ignore_eos": True}))
        for p, s in zip(PROMPTS, FEATURES, strict=True)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"the capture-safe sampler called {name}")
    return refused


def test_serving_steps_sample_with_no_host_read(qwen2, monkeypatch):
    reference = engine_for(qwen2).run_offline(JOBS)  # (the CPU's compiled sampler)
    engine = engine_for(qwen2)
    step = engine.step
    step.sampler.capture_safe = True
    for name in ("native_argmax", "native_scaled_rows", "scaled_gumbel_best", "gumbel_best"):
        monkeypatch.setattr(sampler_module, name, refuse(name))
    guard = HostSyncGuard(strict=("sample",))
    guard.wrap(step, "sample")
    log = PlanLog(step)
    results = engine.run_offline(JOBS)
    assert {"decode", "speculative round", "mixed"} <= log.kinds()
    assert guard.guarded["sample"] == sum(1 for p in log.plans if any(w.samples
                                                                       for w in p.work))
    assert results == reference


def test_the_strict_guard_catches_what_a_capture_cannot_replay():
    guard = HostSyncGuard(strict=("sample",))
    x = torch.arange(6.0)
    with guard.running("sample"):
        with pytest.raises(HostSync, match="boolean-mask indexing"):
            x[x > 2]
        with pytest.raises(HostSync, match="host data"):
            torch.tensor([1, 2])
        with pytest.raises(HostSync, match=r"\.tolist"):
            x.tolist()
        x.masked_fill_(x > 2, 0.0)  # (a mask that keeps the shape is fine)


def capture_safe(vocab: int, rows: int, pad: int = 0) -> ShardedSampler:
    return ShardedSampler(None, 0, vocab, vocab + pad, vocab, rows, capture_safe=True)


@pytest.mark.parametrize("step", range(3))
def test_every_feature_equals_the_oracle_and_the_compiled_sampler(step):
    v, pad = 300, 4
    gen = torch.Generator().manual_seed(70 + step)
    specs = ORDER_ROWS + FILTER_ROWS
    logits = torch.randn(len(specs), v + pad, generator=gen) * 2.5
    logits[:, [4, 9, 17, 200]] += 3.0
    logits[3, 11] = float("nan")
    rows = [RowSampling(seed=31 * i + 2 + (2**63 if i % 4 == 0 else 0), position=step, **p)
            for i, p in enumerate(specs)]
    prompt = [[4, 9, 17, 200, (11 * i) % v] for i in range(len(rows))]
    output = [[4, 17, 17, (23 * i + step) % v][: step + 1] for i in range(len(rows))]
    safe = capture_safe(v, len(rows), pad)
    plan = safe.plan(rows, prompt, output)
    guard = HostSyncGuard(strict=("sample",))
    with guard.running("sample"):
        tokens = safe.run(logits, plan)
    compiled = ShardedSampler(None, 0, v, v + pad, v, len(rows))
    assert torch.equal(tokens, compiled.sample(logits, rows, prompt, output))
    clean = logits.nan_to_num(nan=float("-inf"))
    expected = [oracle.sample(clean[i, :v], r, prompt[i], output[i]) for i, r in enumerate(rows)]
    assert tokens.tolist() == expected
    assert torch.equal(safe.processed(logits, rows, prompt, output),
                       compiled.processed(logits, rows, prompt, output))


def test_wide_rows_pick_the_exhaustive_gumbel_max():
    """151,936-id rows (a Qwen vocabulary) on a shard that starts past 0: greedy, plain,
    filtered and penalized rows, the capture-safe picks equal the compiled sampler's."""
    v, start, width = 151_936, 75_968, 75_968
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, width, generator=gen) * 3.0
    rows = [RowSampling(seed=5, position=1, temperature=0.0),
            RowSampling(seed=6, position=2, temperature=0.8),
            RowSampling(seed=7, position=3, temperature=0.3, top_p=0.8),
            RowSampling(seed=8, position=4, temperature=1.0, top_k=1000, min_p=0.01),
            RowSampling(seed=9, position=5, temperature=0.9, repetition_penalty=1.1)]
    ids = [[start + 3, 17, start + 90_000 - v // 2]] * 5
    safe = ShardedSampler(None, start, width, width, v, 5, capture_safe=True)
    compiled = ShardedSampler(None, start, width, width, v, 5)
    assert torch.equal(safe.sample(logits, rows, ids, ids), compiled.sample(logits, rows, ids, ids))


def test_a_plan_past_the_start_up_cells_overflows_once_then_fits():
    """Penalty cells past the pools' start-up size: the plan still samples what the CPU's
    sampler and the oracle sample (the overflow in one-off tensors); the pools grow once, at
    the next plan, and plans of the same size after that allocate no tensor storage."""
    from tests.capture_guard import allocated_bytes

    v = 3000
    gen = torch.Generator().manual_seed(8)
    rows = [RowSampling(seed=4, position=1, temperature=0.9, repetition_penalty=1.3,
                        frequency_penalty=0.2),
            RowSampling(seed=5, position=2, temperature=0.0, presence_penalty=0.5)]
    history = [list(range(0, 2 * v // 3)), list(range(v // 3, v))]  # (2,000 cells a row)
    safe = capture_safe(v, 2)
    pools = [pool.size for pool in safe.buffers.pools]
    for step in range(4):
        logits = torch.randn(2, v, generator=gen) * 2.0
        plan, allocated = allocated_bytes(lambda: safe.plan(rows, history, history))
        assert (allocated > 0) == (step < 2)  # (the overflow, then the growth)
        tokens = safe.run(logits, plan).tolist()
        assert tokens == ShardedSampler(None, 0, v, v, v, 2).sample(
            logits, rows, history, history).tolist()
        assert tokens == [oracle.sample(logits[i], r, history[i], history[i])
                          for i, r in enumerate(rows)]
    assert safe.buffers.grown == 2  # (int64 and float32)
    assert [pool.size for pool in safe.buffers.pools] != pools
