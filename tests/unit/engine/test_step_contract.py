"""The rank step against the logprobs contract, at TP1 on CPU: phases, records, the gated
reduction, cores without logprob outputs or ID inputs, prepared Triton objects, the stale-frame
check and the bounded per-request event queue."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from helios_logprobs.kernels.api import reduce_logprobs
from helios_logprobs.kernels.layout import EXPORT_K, FIRST_PAIR, PAYLOAD_WORDS
from helios_logprobs.kernels.sortkeys import bits_to_float
from helios_logprobs.ranks import commit
from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.core import capabilities, core_declarations
from helios_logprobs.ranks.contract.declarations import validate
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.ranks.plan import RequestSpec, SlotWork, StepPlan
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import EngineError
from tests.checkpoints import hf_logprobs, write_llama

SENTINEL = -7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


def runtime(model_dir, **overrides) -> RuntimeConfig:
    return RuntimeConfig(model_dir=model_dir, **{"capacity": 4, "max_model_len": 64,
                                                 **overrides})


def spec(ordinal: int, logprobs: bool = True, ids: tuple[int, ...] = ()) -> RequestSpec:
    sampling = RowSampling(seed=ordinal, position=0, temperature=0.0)
    return RequestSpec(ordinal=ordinal, max_tokens=8, sampling=sampling, wants_logprobs=logprobs,
                       logprob_token_ids=ids)


def two_slot_plan(submission: int = 0, logprobs: tuple[bool, bool] = (True, True)) -> StepPlan:
    """Slot 3 is sampling row 0 and slot 1 is sampling row 1 (rows differ from slots)."""
    return StepPlan(submission, (
        SlotWork(3, 1, (5, 6, 7), 0, True, spec(1, logprobs[0])),
        SlotWork(0, 1, (9, 10, 11, 12), 0, False, spec(2)),
        SlotWork(1, 1, (8, 9), 0, True, spec(3, logprobs[1])),
    ))


def capture_logits(step) -> list[torch.Tensor]:
    """Every forward's logits (sampling rows in plan order), recorded on the instance."""
    seen: list[torch.Tensor] = []
    project = step.model.project

    def recording(hidden, out=None):
        logits = project(hidden, out=out)
        seen.append(logits.clone())
        return logits

    step.model.project = recording
    return seen


def reference(logits: torch.Tensor, token: int, k: int, vocab: int) -> torch.Tensor:
    """kernels.reference's packed words for one logit row."""
    return reduce_logprobs(logits, torch.tensor([token]), k=k, vocab_size=vocab,
                           backend="reference")[0]


def payload_values(words: torch.Tensor) -> tuple[int, float, list[int], list[float]]:
    pairs = words[FIRST_PAIR:].view(-1, 2)
    chosen = float(bits_to_float(words[1:2])[0])
    return int(words[0]), chosen, pairs[:, 0].tolist(), bits_to_float(pairs[:, 1]).tolist()


# -------------------------------------------------------------------------- records (3, 4)
def test_ordinary_samples_offer_and_accept_nothing(model_dir):
    step = load_rank(runtime(model_dir), None)
    step.run(two_slot_plan())
    records = step.outputs.completion_records[0]
    for slot in (3, 1):
        assert int(records[slot, abi6.KIND]) == abi6.Kind.SAMPLE
        assert int(records[slot, abi6.EMITTED]) == 1
        assert int(records[slot, abi6.OFFERED]) == 0
        assert int(records[slot, abi6.ACCEPTED]) == 0
    assert int(records[0, abi6.KIND]) == abi6.Kind.ADMISSION


def test_first_logit_row_is_the_row_of_the_logits_the_reduction_reads(model_dir):
    step = load_rank(runtime(model_dir), None)
    seen = capture_logits(step)
    step.run(two_slot_plan())
    records = step.outputs.completion_records[0]
    logits = seen[-1]
    assert [int(records[s, abi6.FIRST_LOGIT_ROW]) for s in (3, 1)] == [0, 1]
    for slot in (3, 1):
        row = int(records[slot, abi6.FIRST_LOGIT_ROW])
        token = int(records[slot, abi6.HEADER])
        assert torch.equal(step.reduction.logits[row], logits[row])
        expected = reference(logits[row : row + 1], token, EXPORT_K, step.model.vocab_size)
        got = step.outputs.completion_logprobs[0, slot, 0]
        chosen, value, ids, values = payload_values(got)
        e_chosen, e_value, e_ids, e_values = payload_values(expected)
        assert chosen == e_chosen == token
        assert ids[:EXPORT_K] == e_ids[:EXPORT_K]
        assert math.isclose(value, e_value, abs_tol=1e-5)
        for a, b in zip(values[:EXPORT_K], e_values[:EXPORT_K], strict=True):
            assert math.isclose(a, b, abs_tol=1e-5)


# -------------------------------------------------------------------------- gate (5)
CORRUPTIONS = {
    "epoch": (abi6.EPOCH, 9),
    "slot": (abi6.SLOT, 2),
    "no emitted token": (abi6.EMITTED, 0),
    "admission kind": (abi6.KIND, int(abi6.Kind.ADMISSION)),
    "another logit row": (abi6.FIRST_LOGIT_ROW, 1),
    "forced position zero": (abi6.FORCED_MASK, 1),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_reduction_gate_reads_the_records_after_the_commit_writer(model_dir, monkeypatch,
                                                                   corruption):
    """Slot 3's record is altered right after the commit writer's flush: the reduction must
    skip that lane (its payload keeps the sentinel) and still serve slot 1."""
    index, value = CORRUPTIONS[corruption]
    flush = commit.RecordBatch.flush

    def corrupting(self, records):
        flush(self, records)
        if int(records[3, abi6.KIND]) == abi6.Kind.SAMPLE:
            records[3, index] = value

    monkeypatch.setattr(commit.RecordBatch, "flush", corrupting)
    step = load_rank(runtime(model_dir), None)
    step.outputs.completion_logprobs.fill_(SENTINEL)
    step.run(two_slot_plan())
    payload = step.outputs.completion_logprobs[0]
    assert torch.all(payload[3] == SENTINEL)
    assert int(payload[1, 0, 0]) == int(step.outputs.completion_records[0, 1, abi6.HEADER])


def test_lanes_without_the_flag_are_never_written(model_dir):
    step = load_rank(runtime(model_dir), None)
    step.outputs.completion_logprobs.fill_(SENTINEL)
    step.run(two_slot_plan(logprobs=(False, True)))
    payload = step.outputs.completion_logprobs[0]
    assert torch.all(payload[3] == SENTINEL) and torch.all(payload[0] == SENTINEL)
    assert int(payload[1, 0, 0]) == int(step.outputs.completion_records[0, 1, abi6.HEADER])
    assert torch.all(step.outputs.completion_logprobs[1] == SENTINEL)


def test_a_submission_without_sampling_rows_uploads_nothing(model_dir):
    """The contract: graphs without logprob outputs receive neither flags nor transfers; the
    next sampling submission uploads the full vectors, clearing unused slots."""
    step = load_rank(runtime(model_dir), None)
    outputs = step.outputs
    prefill = StepPlan(0, (SlotWork(2, 1, (9, 10, 11), 0, False, spec(1, ids=(4, 5))),))
    for name in ("logprob_requested", "logprob_token_id_counts", "logprob_token_ids"):
        getattr(outputs, name).fill_(SENTINEL)
    step.run(prefill)
    for name in ("logprob_requested", "logprob_token_id_counts", "logprob_token_ids"):
        assert torch.all(getattr(outputs, name) == SENTINEL), name
    step.run(two_slot_plan(submission=1))
    assert outputs.logprob_requested.tolist() == [0, 1, 0, 1]
    assert outputs.logprob_token_id_counts.tolist() == [0, 0, 0, 0]


# -------------------------------------------------------------------------- no logprobs (2)
def test_core_without_logprob_outputs_uploads_and_reduces_nothing(model_dir, monkeypatch):
    from helios_logprobs.kernels import sharded
    from helios_logprobs.ranks.contract import upload

    built = []
    for cls in (sharded.PreparedShardedReduction, upload.LogprobUploader):
        init = cls.__init__

        def counting(self, *args, _init=init, **kwargs):
            built.append(type(self).__name__)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    config = runtime(model_dir, logprobs=False)
    step = load_rank(config, None)
    outputs = step.outputs
    for name in ("logprob_requested", "logprob_token_id_counts", "logprob_token_ids"):
        tensor = getattr(outputs, name)
        if tensor is not None:
            tensor.fill_(SENTINEL)
    outputs.completion_logprobs.fill_(SENTINEL)
    engine = build_engine(config, step).start()
    try:
        tokens, _ = engine.generate_sync([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(tokens) == 3
    finally:
        engine.shutdown()
    assert built == []
    for name in ("logprob_requested", "logprob_token_id_counts", "logprob_token_ids"):
        tensor = getattr(outputs, name)
        assert tensor is None or torch.all(tensor == SENTINEL), name
    assert torch.all(outputs.completion_logprobs == SENTINEL)
    assert engine.executor.counters.payload_copies == 0
    assert engine.executor.host_payload.shape[-1] == FIRST_PAIR  # no host payload storage


# -------------------------------------------------------------------------- K < 20, T (7)
def test_k5_core_declares_natural_alternatives_without_id_inputs(model_dir):
    config = runtime(model_dir, max_logprobs=5, completion_token_capacity=3)
    step = load_rank(config, None)
    outputs = step.outputs
    assert tuple(outputs.completion_records.shape) == (2, 4, 16 + 3)
    assert tuple(outputs.completion_logprobs.shape) == (2, 4, 3, 2 + 2 * 5)
    assert set(outputs.tensors()) == {"completion_records", "completion_logprobs",
                                      "logprob_requested"}
    caps = validate(core_declarations(outputs, True), 4, 3)
    assert (caps.k, caps.supports_token_ids) == (5, False)
    assert capabilities(outputs, True) == caps
    assert step.capabilities == caps


def test_k5_engine_serves_natural_alternatives_and_refuses_token_ids(model_dir):
    config = runtime(model_dir, max_logprobs=5)
    step = load_rank(config, None)
    seen = capture_logits(step)
    engine = build_engine(config, step).start()
    try:
        assert (engine.info.max_logprobs, engine.info.supports_token_ids) == (5, False)
        with pytest.raises(RequestError) as err:
            engine.check([5], SamplingParams(logprobs=6))
        assert err.value.param == "logprobs"
        with pytest.raises(RequestError) as err:
            engine.generate_sync([5], SamplingParams(logprob_token_ids=(1, 2)))
        assert err.value.param == "logprob_token_ids"
        prompt = [5, 6, 7]
        tokens, _ = engine.generate_sync(prompt, SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5))
    finally:
        engine.shutdown()
    assert len(tokens) == 4
    ref = hf_logprobs(model_dir, prompt + [t.token_id for t in tokens])
    sampling_logits = [logits for logits in seen if logits.shape[0]]
    vocab = step.model.vocab_size
    for t, logits in zip(tokens, sampling_logits, strict=True):
        expected = reference(logits, t.token_id, 5, vocab)
        _, _, ids, values = payload_values(expected)
        assert [a.token_id for a in t.alternatives] == ids[:5]
        for a, b in zip(t.alternatives, values[:5], strict=True):
            assert math.isclose(a.logprob, b, abs_tol=1e-5)
        row = ref[len(prompt) - 1 + t.index]
        assert math.isclose(t.logprob, float(row[t.token_id]), abs_tol=1e-4)
        for a in t.alternatives:
            assert math.isclose(a.logprob, float(row[a.token_id]), abs_tol=1e-4)
    per_lane = step.outputs.token_capacity * (FIRST_PAIR + 2 * 5) * 4
    assert engine.executor.counters.payload_bytes == len(tokens) * per_lane


def test_completion_token_capacity_reaches_the_bundle(model_dir):
    step = load_rank(runtime(model_dir, completion_token_capacity=3), None)
    assert tuple(step.outputs.completion_records.shape) == (2, 4, 19)
    assert tuple(step.outputs.completion_logprobs.shape) == (2, 4, 3, PAYLOAD_WORDS)
    assert step.capabilities.supports_token_ids


# -------------------------------------------------------------------------- stale frame (6)
@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_frame_from_another_submission_fails_the_request(model_dir, logprobs):
    config = runtime(model_dir)
    step = load_rank(config, None)
    run = step.run

    def stale(plan):
        run(plan)
        step.outputs.completion_records[plan.frame, :, abi6.SUBMISSION] += 2

    step.run = stale
    engine = build_engine(config, step).start()
    try:
        with pytest.raises(EngineError, match="submission"):
            engine.generate_sync([5, 6], SamplingParams(
                max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=logprobs))
        assert engine.healthy()
    finally:
        engine.shutdown()


# -------------------------------------------------------------------------- triton (8)
def compiled_kernels() -> int:
    """Compiled variants of every Triton kernel (0 under the interpreter, which compiles
    nothing)."""
    from helios_logprobs.kernels.triton import common, sharded_kernels

    kernels = [getattr(m, n) for m in (common, sharded_kernels) for n in dir(m)]
    caches = [k.device_caches for k in kernels if hasattr(k, "device_caches")]
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


@pytest.mark.triton_cpu
def test_triton_objects_are_prepared_before_the_first_logprob_step(model_dir, monkeypatch):
    """On CPU the kernels run in the interpreter (tests/conftest.py); on a GPU they compile,
    and the first logprob step must compile nothing new either."""
    pytest.importorskip("triton")
    from helios_logprobs.kernels.triton import sharded

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(sharded, "_PREPARED", {})
    step = load_rank(runtime(model_dir, capacity=2, reduction_backend="triton", device=device),
                     None)
    assert sharded._PREPARED, "no prepared Triton reduction after start-up"

    def snapshot():
        return {key: [(id(p), p.rows, {k: id(v) for k, v in p._starts.items()}) for p in entries]
                for key, entries in sharded._PREPARED.items()}

    before, compiled = snapshot(), compiled_kernels()
    assert max(p[1] for entries in before.values() for p in entries) >= 2
    plan = StepPlan(0, (SlotWork(1, 1, (5, 6, 7), 0, True, spec(1)),
                        SlotWork(0, 1, (8,), 0, True, spec(2, ids=(3, 40, 7)))))
    step.run(plan)
    assert snapshot() == before
    assert compiled_kernels() == compiled
    records = step.outputs.completion_records[0].cpu()
    payload = step.outputs.completion_logprobs[0].cpu()
    assert int(payload[1, 0, 0]) == int(records[1, abi6.HEADER])
    assert payload[0, 0, FIRST_PAIR : FIRST_PAIR + 6 : 2].tolist() == [3, 40, 7]


# -------------------------------------------------------------------------- bounded queue (9)
def test_a_consumer_that_falls_behind_is_aborted_without_losing_events(model_dir):
    config = runtime(model_dir, max_pending_frames=3)
    step = load_rank(config, None)
    engine = build_engine(config, step).start()
    bound = 3 * step.outputs.token_capacity

    async def slow_then_fast() -> tuple[list, BaseException | None]:
        stream = engine.generate([5, 6], SamplingParams(
            max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=1))
        events = [await stream.__anext__()]
        deadline = time.monotonic() + 30
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # not consuming: the step thread must not wait for us
        error = None
        try:
            async for event in stream:
                events.append(event)
        except EngineError as exc:
            error = exc
        return events, error

    async def prompt_consumer() -> list:
        return [e async for e in engine.generate([7, 8], SamplingParams(
            max_tokens=60, temperature=0.0, ignore_eos=True))]

    try:
        events, error = asyncio.run(slow_then_fast())
        assert error is not None and "too slow" in str(error)
        assert [e.index for e in events] == list(range(len(events)))
        assert bound <= len(events) <= bound + 1
        assert engine.healthy()
        fast = asyncio.run(prompt_consumer())
        assert len(fast) == 61 and fast[-1].reason == "length"
        tokens, _ = engine.generate_sync([5, 6], SamplingParams(
            max_tokens=60, temperature=0.0, ignore_eos=True))
        assert [t.token_id for t in tokens[: len(events)]] == [e.token_id for e in events]
    finally:
        engine.shutdown()
