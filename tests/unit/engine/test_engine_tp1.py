"""The coordinator engine in-process at TP1: payload copies, failures, stops, limits."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from helios_logprobs.kernels.layout import EXPORT_K, FIRST_PAIR
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import EngineError, GeneratedToken
from tests.checkpoints import hf_logprobs, write_llama
from tests.oracles import check_natural


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture()
def engine(model_dir):
    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=64)
    engine = build_engine(config, load_rank(config, None)).start()
    yield engine
    engine.shutdown()


def run_all(engine, jobs):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: engine.generate_sync(*job), jobs))


def test_frames_without_requesting_lanes_copy_no_payload(engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    run_all(engine, [([5, 6, 7], params), ([8, 9], params)])
    counters = engine.executor.counters
    assert counters.frames > 0 and counters.record_bytes > 0
    assert counters.payload_copies == 0 and counters.payload_bytes == 0


def test_mixed_batch_copies_only_requesting_lanes(engine):
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    wanting = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    results = run_all(engine, [([5, 6, 7], plain), ([5, 6, 7], wanting), ([9], plain)])
    (plain_tokens, _), (lp_tokens, _), _ = results
    assert [t.token_id for t in plain_tokens] == [t.token_id for t in lp_tokens]
    assert all(t.logprob is None for t in plain_tokens)
    token_capacity = engine.step.outputs.token_capacity
    per_lane = token_capacity * (FIRST_PAIR + 2 * EXPORT_K) * 4
    # Exactly one lane's prefix per frame in which the requesting request sampled a token.
    assert engine.executor.counters.payload_bytes == len(lp_tokens) * per_lane


def test_selected_ids_wider_than_k_copy_their_width(engine, model_dir):
    ids = tuple(range(100, 130))
    tokens, _ = engine.generate_sync([4, 5], SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, logprob_token_ids=ids))
    ref = hf_logprobs(model_dir, [4, 5] + [t.token_id for t in tokens])
    for t in tokens:
        assert [a.token_id for a in t.alternatives] == list(ids)
        for a in t.alternatives:
            assert math.isclose(a.logprob, float(ref[1 + t.index, a.token_id]), abs_tol=1e-4)
    per_lane = engine.step.outputs.token_capacity * (FIRST_PAIR + 2 * len(ids)) * 4
    assert engine.executor.counters.payload_bytes == len(tokens) * per_lane


def test_eos_ends_without_entry_and_ignore_eos_keeps_it(engine):
    eos = engine.info.eos_token_ids[0]
    forced = ((eos, 100.0),)
    tokens, finish = engine.generate_sync([5, 6], SamplingParams(
        max_tokens=4, temperature=0.0, logit_bias=forced, logprobs=2))
    assert tokens == [] and finish.reason == "stop" and finish.stop_token_id == eos
    tokens, finish = engine.generate_sync([5, 6], SamplingParams(
        max_tokens=3, temperature=0.0, logit_bias=forced, logprobs=2, ignore_eos=True))
    assert [t.token_id for t in tokens] == [eos] * 3 and finish.reason == "length"
    assert all(t.logprob is not None for t in tokens)


def test_stop_token_ids_clip_and_length_limit(engine):
    tokens, finish = engine.generate_sync([5, 6], SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))
    stop_at = tokens[3].token_id
    first = next(i for i, t in enumerate(tokens) if t.token_id == stop_at)
    clipped, finish = engine.generate_sync([5, 6], SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, stop_token_ids=(stop_at,)))
    assert [t.token_id for t in clipped] == [t.token_id for t in tokens[:first]]
    assert finish.reason == "stop" and finish.stop_token_id == stop_at
    long_prompt = list(range(3, 3 + 60))
    tokens, finish = engine.generate_sync(long_prompt, SamplingParams(
        max_tokens=50, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 64 - 60 and finish.reason == "length"


def test_requests_refused_before_admission(engine):
    with pytest.raises(RequestError) as err:
        engine.generate_sync([5], SamplingParams(logprob_token_ids=(1, 100000)))
    assert err.value.param == "logprob_token_ids"
    with pytest.raises(RequestError) as err:
        engine.generate_sync(list(range(1, 70)), SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(RequestError) as err:
        engine.check([5], SamplingParams(logprobs=21))
    assert err.value.param == "logprobs"
    with pytest.raises(RequestError) as err:
        engine.check([5], SamplingParams(top_p=0.0))
    assert err.value.param == "top_p"


def test_each_request_is_checked_and_its_spec_built_once(engine, caplog):
    """A temperature below vLLM's floor is warned about once per request, as vLLM does: the
    submitting paths run the one check, whose spec goes to the ranks (no second build)."""
    params = SamplingParams(max_tokens=2, temperature=0.005, seed=3, ignore_eos=True)

    async def stream():
        return [event async for event in engine.generate([5, 6], params)]

    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.engine"):
        engine.generate_sync([5, 6], params)
        assert caplog.text.count("maxed it out to 0.01") == 1
        asyncio.run(stream())
        assert caplog.text.count("maxed it out to 0.01") == 2


def test_core_without_logprob_buffers_refuses_logprobs(model_dir):
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=64, logprobs=False)
    engine = build_engine(config, load_rank(config, None)).start()
    try:
        assert engine.info.max_logprobs == 0 and not engine.info.allow_logprobs
        with pytest.raises(RequestError) as err:
            engine.generate_sync([5], SamplingParams(logprobs=0))
        assert err.value.param == "logprobs"
        tokens, _ = engine.generate_sync([5], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(tokens) == 2
    finally:
        engine.shutdown()


def test_non_finite_logits_fail_only_the_requesting_request(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    weights["lm_head.weight"][17] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    config = RuntimeConfig(model_dir=broken, capacity=2, max_model_len=64)
    step = load_rank(config, None)
    sampled_together: list[set[int]] = []  # per step, the slots that sampled a token
    run = step.run

    def recording(plan):
        sampled_together.append({work.slot for work in plan.work if work.samples})
        return run(plan)

    step.run = recording
    engine = build_engine(config, step)  # started once both requests are in: one batch
    lp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, ignore_eos=True)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                           allowed_token_ids=tuple(range(20, 40)))

    async def collect(params: SamplingParams):
        tokens = []
        try:
            async for event in engine.generate([5, 6], params):
                if isinstance(event, GeneratedToken):
                    tokens.append(event)
        except EngineError as exc:
            return exc
        return tokens

    async def both() -> list:
        tasks = [asyncio.ensure_future(collect(p)) for p in (lp, plain)]
        await asyncio.sleep(0)  # each task runs up to its first wait: both are submitted
        engine.start()
        return await asyncio.gather(*tasks)

    try:
        failed, tokens = asyncio.run(both())
        healthy = engine.healthy()
    finally:
        engine.shutdown()
    assert sampled_together[0] == {0, 1}, sampled_together  # the same batch
    assert isinstance(failed, EngineError) and re.search("non-finite|NaN", str(failed)), failed
    assert len(tokens) == 2 and all(20 <= t.token_id < 40 for t in tokens)
    assert healthy


def test_generated_logprobs_match_transformers_with_chunked_prefill(model_dir):
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=128, chunk_size=7)
    engine = build_engine(config, load_rank(config, None)).start()
    try:
        prompt = [(i * 37) % 290 + 3 for i in range(30)]
        tokens, _ = engine.generate_sync(prompt, SamplingParams(
            max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=20))
    finally:
        engine.shutdown()
    ref = hf_logprobs(model_dir, prompt + [t.token_id for t in tokens])
    assert len(tokens) == 5
    for t in tokens:
        row = ref[len(prompt) - 1 + t.index]
        assert t.token_id == int(torch.argmax(row))
        assert math.isclose(t.logprob, float(row[t.token_id]), abs_tol=1e-4)
        # The 20 alternatives asked for: transformers' natural top-20 of the same row.
        check_natural([(a.token_id, a.logprob) for a in t.alternatives], row, 20)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"allowed_token_ids": (5, 5)}, "allowed_token_ids"),
        ({"seed": 2**70}, "seed"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"stop_token_ids": (10**6,)}, "stop_token_ids"),
    ],
)
def test_sampling_parameters_refused_before_they_reach_the_ranks(engine, params, param):
    with pytest.raises(RequestError) as err:
        engine.generate_sync([5, 6], SamplingParams(max_tokens=2, **params))
    assert err.value.param == param
    tokens, _ = engine.generate_sync([5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(tokens) == 2 and engine.healthy()


def test_generation_config_eos_ids_also_stop(model_dir, tmp_path):
    import json

    chat = tmp_path / "chat"
    chat.mkdir()
    for f in model_dir.iterdir():
        (chat / f.name).write_bytes(f.read_bytes())
    (chat / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = RuntimeConfig(model_dir=chat, capacity=2, max_model_len=64)
    engine = build_engine(config, load_rank(config, None)).start()
    try:
        assert engine.info.eos_token_ids == (2, 7)
        tokens, finish = engine.generate_sync([5, 6], SamplingParams(
            max_tokens=4, temperature=0.0, logit_bias=((7, 100.0),), logprobs=1))
        assert tokens == [] and finish.stop_token_id == 7
    finally:
        engine.shutdown()


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_sampled_id_outside_the_vocabulary_fails_only_its_request(model_dir, logprobs):
    """A sampler fault (its empty pick, 2**31 - 1) must not reach the reduction's reads nor
    the next step's embedding: the reduction's gate skips the row, the host fails that
    request, and the other request of the same batch and later requests are served."""
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=64)
    step = load_rank(config, None)
    run = step.sampler.run

    def faulty(logits, plan):
        tokens = run(logits, plan)
        for i, prompt in enumerate(plan.prompt_ids):
            if list(prompt) == [5, 6] and len(plan.output_ids[i]) == 1:
                tokens[i] = 2**31 - 1
        return tokens

    step.sampler.run = faulty
    engine = build_engine(config, step)
    bad = SamplingParams(max_tokens=4, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    good = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)

    async def collect(prompt: list[int], params: SamplingParams):
        tokens = []
        try:
            async for event in engine.generate(prompt, params):
                if isinstance(event, GeneratedToken):
                    tokens.append(event)
        except EngineError as exc:
            return tokens, exc
        return tokens, None

    async def both() -> list:
        tasks = [asyncio.ensure_future(collect(p, s)) for p, s in (([5, 6], bad), ([7, 8], good))]
        await asyncio.sleep(0)
        engine.start()
        return await asyncio.gather(*tasks)

    try:
        (bad_tokens, error), (good_tokens, good_error) = asyncio.run(both())
        healthy = engine.healthy()
        later, _ = engine.generate_sync([5, 6, 9], good)
    finally:
        engine.shutdown()
    assert error is not None and "outside the vocabulary" in str(error), error
    assert len(bad_tokens) == 1  # the token before the fault
    assert good_error is None and len(good_tokens) == 4
    assert all(t.logprob is not None and math.isfinite(t.logprob) for t in good_tokens)
    assert healthy and len(later) == 4
