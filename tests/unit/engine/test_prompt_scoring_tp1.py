"""Scored prefill through the engine at TP1, against transformers on the same checkpoint."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.ranks.plan import RequestSpec, SlotWork, StepPlan
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, PromptScores
from tests.checkpoints import hf_logprobs, write_llama, write_qwen2

TOL = 1e-4
NEAR_TIE = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def scoring_engine(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model_dir = write_llama(path) if request.param == "llama" else write_qwen2(path)
    config = RuntimeConfig(model_dir=model_dir, capacity=3, max_model_len=1024, chunk_size=256,
                           prompt_logprobs=True)
    engine = build_engine(config, load_rank(config, None)).start()
    yield model_dir, engine
    engine.shutdown()


def prompt_entries(events) -> list:
    entries = [e for event in events if isinstance(event, PromptScores) for e in event.entries]
    first_token = next((i for i, e in enumerate(events) if isinstance(e, GeneratedToken)),
                       len(events))
    last_scores = max((i for i, e in enumerate(events) if isinstance(e, PromptScores)),
                      default=-1)
    assert last_scores < first_token, "prompt scores must precede generated tokens"
    return entries


def check_scores(model_dir, prompt: list[int], entries, n: int) -> None:
    rows = hf_logprobs(model_dir, prompt)  # row i predicts prompt[i + 1]
    assert [e.position for e in entries] == list(range(1, len(prompt)))
    for e in entries:
        row = rows[e.position - 1]
        assert e.token_id == prompt[e.position]
        want = float(row[e.token_id])
        assert abs(e.logprob - want) <= TOL, (e.position, e.logprob, want)
        # rank = 1 + ids strictly greater; near-ties may go either way
        above = int((row > want + NEAR_TIE).sum())
        at_most = int((row > want - NEAR_TIE).sum())
        assert 1 + above <= e.rank <= at_most, (e.position, e.rank, above, at_most)
        assert len(e.alternatives) == min(n, row.numel())
        for (id_a, a), (id_b, b) in zip(e.alternatives, e.alternatives[1:], strict=False):
            assert a > b or (a == b and id_a < id_b)
        for token_id, value in e.alternatives:
            assert abs(value - float(row[token_id])) <= TOL
        if e.alternatives:
            rest = row.clone()
            rest[[t for t, _ in e.alternatives]] = float("-inf")
            assert float(rest.max()) <= e.alternatives[-1][1] + TOL


@pytest.mark.parametrize("length", [1, 2, 128, 129, 700])
def test_prompt_positions_match_transformers(scoring_engine, length):
    model_dir, engine = scoring_engine
    prompt = [(7 * i + 3) % 290 + 5 for i in range(length)]
    events = engine.events_sync(prompt, SamplingParams(max_tokens=0, prompt_logprobs=20))
    assert events[-1] == Finished("length")
    assert not any(isinstance(e, GeneratedToken) for e in events)
    check_scores(model_dir, prompt, prompt_entries(events), 20)


def test_scored_and_unscored_requests_share_steps(scoring_engine):
    model_dir, engine = scoring_engine
    prompts = [[(5 * i + 1) % 280 + 3 for i in range(300)], [4, 9, 16, 25], [30, 31, 32]]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=5,
                             prompt_logprobs=3),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0)]
    results: list = [None] * 3

    def run(i: int) -> None:
        results[i] = engine.events_sync(prompts[i], params[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for prompt, p, events in zip(prompts, params, results, strict=True):
        entries = prompt_entries(events)
        if p.prompt_logprobs is None:
            assert not entries
        else:
            check_scores(model_dir, prompt, entries, p.prompt_logprobs)
        tokens = [e for e in events if isinstance(e, GeneratedToken)]
        assert len(tokens) == p.max_tokens
        generated = [t.token_id for t in tokens]
        rows = hf_logprobs(model_dir, prompt + generated)[len(prompt) - 1:]
        for j, token in enumerate(tokens):
            assert float(rows[j, token.token_id]) >= float(rows[j].max()) - TOL  # greedy
            if p.logprobs is not None:
                assert abs(token.logprob - float(rows[j, token.token_id])) <= TOL


def test_scoring_refused_without_the_flag(tmp_path):
    model_dir = write_llama(tmp_path / "m")
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=64)
    step = load_rank(config, None)
    assert step.scorer is None  # nothing for scoring exists
    engine = build_engine(config, step).start()
    try:
        assert not engine.info.prompt_logprobs
        with pytest.raises(RequestError) as err:
            engine.check([1, 2], SamplingParams(prompt_logprobs=1))
        assert err.value.param == "prompt_logprobs"
    finally:
        engine.shutdown()


def test_prompt_logprobs_range(scoring_engine):
    _, engine = scoring_engine
    for bad in (21, -1):
        with pytest.raises(RequestError) as err:
            engine.check([1, 2], SamplingParams(prompt_logprobs=bad))
        assert err.value.param == "prompt_logprobs"


class OutputShapes(TorchDispatchMode):
    """Records the shape of every floating-point tensor any torch op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.shapes.append(tuple(t.shape))
        return out


def test_scoring_never_materializes_more_than_64_vocabulary_rows(scoring_engine):
    """The only scoring logit matrix is [64, local_vocabulary]: scoring a 700-token prompt
    makes no float tensor with more than 64 rows of vocabulary width (no [rows, vocabulary]
    FP32 copy), while the forward itself does run (a control on what is recorded)."""
    model_dir, engine = scoring_engine
    vocab = engine.info.vocab_size
    prompt = [(3 * i + 2) % 250 + 7 for i in range(700)]
    step = engine.step
    with OutputShapes() as recorded:
        # One scored plan on this thread (the engine's own thread is idle and not traced).
        spec = RequestSpec(9999, max_tokens=0, sampling=RowSampling(seed=1, position=0),
                           scores_prompt=True)
        targets = (*prompt[1:256], prompt[256])
        work = SlotWork(2, 10**6, tuple(prompt[:256]), 0, samples=False, request=spec,
                        targets=targets)
        step.run(StepPlan(10**6, (work,)))
    wide = [s for s in recorded.shapes if len(s) == 2 and s[-1] >= vocab]
    assert any(s[0] == 64 for s in wide), "the control saw no scoring logit block"
    assert all(s[0] <= 64 for s in wide), sorted(set(wide))
