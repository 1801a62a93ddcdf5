"""The scheduler's token budget: decodes first, prefill chunks cut at the budget, nothing
prefilled twice or skipped, and every request eventually runs."""

from __future__ import annotations

from helios_logprobs.ranks.plan import RequestSpec
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.scheduler import Request, Scheduler, SchedulerConfig


def request(ordinal: int, prompt_len: int) -> Request:
    spec = RequestSpec(ordinal, max_tokens=4, sampling=RowSampling(seed=ordinal, position=0))
    prompt = [100 * ordinal + i for i in range(prompt_len)]
    return Request(ordinal, prompt, SamplingParams(max_tokens=4), spec, sink=None)


def test_budget_is_never_exceeded_and_every_prompt_token_runs_once():
    config = SchedulerConfig(capacity=3, max_seq_len=128, chunk_size=8, max_batched_tokens=10)
    scheduler = Scheduler(config)
    requests = [request(1, 21), request(2, 5), request(3, 3), request(4, 2)]
    for r in requests:
        scheduler.add(r)
    fed: dict[int, list[int]] = {r.ordinal: [] for r in requests}
    by_slot = {}
    exhausted = 0
    for _ in range(40):
        step = scheduler.next_plan()
        if step is None:
            break
        plan, carried = step
        by_slot = {r.slot: r for r in carried}
        total = sum(len(w.tokens) for w in plan.work)
        assert total <= config.max_batched_tokens
        exhausted += total == config.max_batched_tokens
        kinds = [len(by_slot[w.slot].prompt) == by_slot[w.slot].prefilled and
                 w.start >= len(by_slot[w.slot].prompt) for w in plan.work]
        # Decodes (one token past the prompt) come before every prefill chunk.
        assert kinds == sorted(kinds, reverse=True)
        for work in plan.work:
            r = by_slot[work.slot]
            assert len(work.tokens) <= config.chunk_size
            if work.start < len(r.prompt):
                assert work.start == len(fed[r.ordinal])  # contiguous, in order
                fed[r.ordinal].extend(work.tokens)
            if work.samples:
                r.generated.append(7)
                if len(r.generated) == r.spec.max_tokens:
                    scheduler.finish(r)
    assert exhausted > 0, "the budget never ran out: the test does not exercise it"
    for r in requests:
        assert fed[r.ordinal] == r.prompt, r.ordinal
        assert r.done and len(r.generated) == 4
    assert not scheduler.has_work()
