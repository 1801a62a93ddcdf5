"""The step's capture-safe phases at TP1 on CPU (issue 36): prepare makes every host decision
and writes the step's static input buffers and the sampler's plan buffers; forward, sample
(the capture-safe sampler, the one a compiled or captured step runs), commit, reduce and score
then run real serving steps (decode, chunked prefill, mixed submissions, selected IDs, scored
prefill, speculative rounds, logprobs on and off) under a guard that raises on any host read
of a tensor (tests/capture_guard.py; strict in the sample phase: no tensor built from host
data either), prepare allocates no tensor storage, the sample phase keeps none (every
intermediate freed; its tokens in the sampler's static buffer), and the buffers the phases read
and write keep their storage.

What the guard leaves out, and why:
- the reduction's and prompt scoring's CPU launches (kernels/cpu, kernels/scoring: compiled C
  over numpy pointers, the CPU-only path) are exempt: on CUDA the same six launches are the
  prepared Triton kernels, which read no value on the host. Likewise the TP1 CPU gate in C
  (gate.c) is switched off here so the tensor gate, the one CUDA runs, is what is guarded.
- the sample phase runs the capture-safe sampler (``capture_safe=True``: CUDA's default and
  the compiled step's); the CPU's default sampler prunes its Gumbel candidates with host
  reads (test_capture_sample.py compares the two). After it, ``readback`` is the step's one
  deliberate read (the commit writer runs on the host with the sampled tokens).
- the sample phase's eager CPU intermediates are allocated and freed inside it (what a
  captured graph holds in its pool): the test asserts that none outlives the phase.
"""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.runtime.engine.client import SamplingParams
from tests.capture_guard import HostSync, HostSyncGuard, allocated_bytes, retained_bytes
from tests.checkpoints import write_qwen2
from tests.serving_engines import serving_engine
from tests.spec_helpers import JOBS, assert_same_results

GUARDED = ("forward", "sample", "commit", "reduce", "score")
SCORED = ([4, 8, 15, 16, 23, 42] * 4, SamplingParams(max_tokens=6, temperature=0.0,
                                                     prompt_logprobs=2, logprobs=3,
                                                     ignore_eos=True))
LONG = ([(7 * i) % 290 + 3 for i in range(30)], SamplingParams(max_tokens=5, temperature=0.0,
                                                                 logprobs=20, ignore_eos=True))
SERVING = [*JOBS, SCORED, LONG, *JOBS[:3]]
"""Decode with and without logprobs, selected IDs, seeded sampling, rounds, a scored prompt,
and prompts longer than the chunk (chunked prefill beside decoding slots)."""


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def engine_for(model_dir):
    return serving_engine(model_dir)


class PlanLog:
    """Every plan the step ran, and what kinds of work they held."""

    def __init__(self, step) -> None:
        self.plans: list[StepPlan] = []
        run = step.run

        def logging(plan):
            self.plans.append(plan)
            return run(plan)

        step.run = logging

    def kinds(self) -> set[str]:
        seen = set()
        for plan in self.plans:
            samples = [w for w in plan.work if w.samples]
            prefill = [w for w in plan.work if not w.samples]
            seen |= {"decode"} if samples else set()
            seen |= {"chunked prefill"} if any(w.start > 0 for w in prefill) else set()
            seen |= {"mixed"} if samples and prefill else set()
            seen |= {"speculative round"} if any(w.proposals for w in samples) else set()
            seen |= {"scored prefill"} if any(w.targets for w in plan.work) else set()
        return seen


def guarded_engine(model_dir):
    engine = engine_for(model_dir)
    step = engine.step
    step.sampler.capture_safe = True  # (the compiled / captured step's sampler)
    guard = HostSyncGuard(strict=("sample",))
    for phase in GUARDED:
        guard.wrap(step, phase)
    reduction = step.reduction
    reduction.native = reduction.call = None  # the tensor gate (CUDA's), not gate.c
    driver = reduction.driver
    reduction.driver = lambda *args: guard_exempt(guard, driver, *args)
    guard.exempt(step.scorer, "scoring")
    return engine, guard, PlanLog(step)


def guard_exempt(guard, call, *args):
    with guard.allow():
        return call(*args)


def test_serving_steps_read_no_tensor_on_the_host_outside_prepare(qwen2):
    engine, guard, log = guarded_engine(qwen2)
    results = engine.run_offline(SERVING)
    assert log.kinds() == {"decode", "chunked prefill", "mixed", "speculative round",
                           "scored prefill"}
    assert any(w.request and w.request.logprob_token_ids for p in log.plans for w in p.work)
    assert {phase: guard.guarded.get(phase, 0) > 0 for phase in GUARDED} == dict.fromkeys(
        GUARDED, True)
    assert guard.guarded["forward"] == len(log.plans)
    assert guard.guarded["sample"] == sum(any(w.samples for w in p.work) for p in log.plans)
    # The guarded run serves exactly what an unguarded engine (the CPU's default sampler)
    # serves.
    assert_same_results(engine_for(qwen2).run_offline(SERVING), results)


def test_the_guard_catches_a_host_read_inside_a_phase(qwen2):
    """Without prepare's host lists the forward reads its inputs back (tolist): caught; and a
    single .item() inside the reduce phase is caught."""
    engine, guard, _ = guarded_engine(qwen2)
    step = engine.step
    inputs = step.prepare(StepPlan(0, ()))
    with pytest.raises(HostSync, match=r"tolist\(\) inside the forward"):
        forward_hidden = step.model.forward_hidden
        step.model.forward_hidden = lambda *args: forward_hidden(*args[:4])
        step.forward(inputs.__class__(**{**vars(inputs), "token_ids": torch.ones(1).long(),
                                        "positions": torch.zeros(1).long(),
                                        "slots": torch.zeros(1).long(),
                                        "row_index": torch.zeros(1).long()}))
    with guard.running("reduce"), pytest.raises(HostSync, match=r"\.item\(\) inside the reduce"):
        step.reduction.requested.sum().item()


def test_prepare_and_sample_allocate_nothing_and_the_buffers_keep_their_storage(qwen2):
    engine = engine_for(qwen2)
    step = engine.step
    step.sampler.capture_safe = True
    allocations: list[int] = []
    storages: list[set[int]] = []
    sampled: list[tuple[int, int]] = []
    reduce = step.reduce

    def recorded_reduce(inputs, logits):
        if logits is not None:
            storages[-1].add(logits.untyped_storage().data_ptr())
        return reduce(inputs, logits)

    measure_prepare(step, allocations, storages)
    measure_sample(step, sampled)
    step.reduce = recorded_reduce
    bundle = step.outputs
    plan_pools = [pool.values for pool in step.sampler.buffers.pools]
    fixed = [bundle.completion_records, bundle.completion_logprobs, bundle.logprob_requested,
             bundle.logprob_token_ids, step.reduction.out, step.reduction.requested,
             step.sampler.tokens, step.sampler.scratch, *plan_pools]
    before = [t.untyped_storage().data_ptr() for t in fixed]
    results = engine.run_offline(SERVING)
    assert len(allocations) > 20 and len(sampled) > 20
    assert allocations == [0] * len(allocations)
    tokens = step.sampler.tokens.untyped_storage().data_ptr()
    assert sampled == [(0, tokens)] * len(sampled)
    assert step.sampler.buffers.grown == 0
    every = set().union(*storages)
    assert every == {step.buffers.values.untyped_storage().data_ptr(),
                     step.reduction.logits.untyped_storage().data_ptr()}
    assert [t.untyped_storage().data_ptr() for t in fixed] == before
    assert_same_results(engine_for(qwen2).run_offline(SERVING), results)


def measure_prepare(step, allocations: list[int], storages: list[set[int]] | None = None):
    """Wrap step.prepare (the sampler's plan included): the bytes each call allocates (the
    profiler's memory events) go to allocations, the storages of the inputs it hands on to
    storages."""
    prepare = step.prepare

    def measured(plan):
        inputs, allocated = allocated_bytes(lambda: prepare(plan))
        allocations.append(allocated)
        if storages is not None:
            storages.append({t.untyped_storage().data_ptr() for t in (
                inputs.token_ids, inputs.positions, inputs.slots, inputs.logit_index,
                inputs.scored_index, inputs.row_index, inputs.row_tensors)})
        return inputs

    step.prepare = measured


def measure_sample(step, sampled: list[tuple[int, int]]):
    """Wrap step.sample: (bytes still held when it returns, the tokens' storage) per call."""
    sample = step.sample

    def measured(inputs, logits):
        tokens, held = retained_bytes(lambda: sample(inputs, logits))
        if tokens is not None:
            sampled.append((held, tokens.untyped_storage().data_ptr()))
        return tokens

    step.sample = measured
