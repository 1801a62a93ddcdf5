"""The capture-safe phases at TP2 over gloo (issue 36): every rank serves the mixed run of
tests/unit/ranks/test_capture_safe_step.py with forward (its all-reduces included), sample
(the capture-safe sampler with its filter and pick exchanges, under the strict guard),
commit, reduce (the tensor gate; the CPU launches and their exchanges exempt, as at TP1) and
score under the host-read guard, prepare allocating nothing (the sampler's plan included),
the sample phase's tokens in the sampler's static buffer, and serves what a TP1 engine
serves. (The sample phase's net bytes are checked at TP1 only: gloo's all-gather leaves
blocks whose frees the profiler does not see.)"""

from __future__ import annotations

import pytest

from tests.checkpoints import write_qwen2
from tests.distributed.harness import run_ranks
from tests.spec_helpers import assert_same_results

pytestmark = pytest.mark.slow


def rank_main(model_dir: str) -> dict:
    from helios_logprobs.collectives.groups import world_group
    from tests.capture_guard import HostSyncGuard
    from tests.serving_engines import serving_engine
    from tests.unit.ranks.test_capture_safe_step import (
        GUARDED,
        SERVING,
        PlanLog,
        guard_exempt,
        measure_prepare,
        measure_sample,
    )

    engine = serving_engine(model_dir, world_group())
    step = engine.step
    step.sampler.capture_safe = True  # (CUDA's sampler, its exchanges inside the phase)
    guard = HostSyncGuard(strict=("sample",))
    for phase in GUARDED:
        guard.wrap(step, phase)
    reduction = step.reduction
    reduction.native = reduction.call = None
    driver = reduction.driver
    reduction.driver = lambda *args: guard_exempt(guard, driver, *args)
    guard.exempt(step.scorer, "scoring")
    allocations, sampled = [], []
    measure_prepare(step, allocations)
    measure_sample(step, sampled)
    log = PlanLog(step)
    events = engine.run_offline(SERVING)
    return {"events": events, "guarded": guard.guarded, "kinds": log.kinds(),
            "plans": len(log.plans), "allocations": allocations,
            "sampled": sampled, "tokens": step.sampler.tokens.untyped_storage().data_ptr()}


def test_tp2_phases_read_nothing_back_and_serve_the_tp1_results(tmp_path):
    model_dir = write_qwen2(tmp_path / "qwen2")
    ranks = run_ranks(rank_main, 2, str(model_dir), timeout_s=600)
    (tp1,) = run_ranks(rank_main, 1, str(model_dir), timeout_s=600)
    for rank in ranks:
        assert rank["kinds"] == {"decode", "chunked prefill", "mixed", "speculative round",
                                 "scored prefill"}
        assert rank["guarded"]["forward"] == rank["plans"]
        assert all(rank["guarded"][phase] > 0 for phase in ("sample", "commit", "reduce",
                                                             "score"))
        assert rank["allocations"] == [0] * rank["plans"]
        assert [ptr for _, ptr in rank["sampled"]] == [rank["tokens"]] * rank["guarded"]["sample"]
        assert_same_results(tp1["events"], rank["events"])
