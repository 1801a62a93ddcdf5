"""The scheduler's side of structured outputs: a constrained request's sampling items carry one
bitmask row per sampling row (the prefill's last chunk and every decode), the proposals the
grammar rejects are cut from a speculative round, and a request the backend cannot serve, or
whose committed token the grammar rejects, ends with an error event, not a failed engine."""

from __future__ import annotations

import numpy as np

from helios_logprobs.ranks.grammar_mask import allowed_ids
from helios_logprobs.ranks.plan import RequestSpec
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.scheduler import Request, Scheduler, SchedulerConfig
from helios_logprobs.runtime.outputs import EngineError
from helios_logprobs.runtime.structured.backend import GrammarBackend
from helios_logprobs.runtime.structured.spec import StructuredSpec

VOCAB = [b"a", b"b", b"c", b"", b"ab"]
EOS = 3
SPEC = StructuredSpec("regex", "(ab)+c")


class Sink:
    def __init__(self) -> None:
        self.events = []

    def put(self, event) -> bool:
        self.events.append(event)
        return True


class Backend:
    def __init__(self) -> None:
        self.backend = GrammarBackend(VOCAB, len(VOCAB), [EOS])

    def state(self, spec):
        return self.backend.state(spec)


def request(ordinal: int, spec: StructuredSpec | None = SPEC) -> Request:
    rows = RequestSpec(ordinal, max_tokens=8, sampling=RowSampling(seed=ordinal, position=0))
    return Request(ordinal, [0, 1], SamplingParams(max_tokens=8, structured=spec), rows, Sink())


def scheduler(speculative: int = 0) -> Scheduler:
    config = SchedulerConfig(capacity=2, max_seq_len=64, speculative_tokens=speculative,
                             ngram_min=1)
    made = Scheduler(config)
    made.grammars = Backend()
    return made


def allowed(mask: bytes) -> list[int]:
    return np.nonzero(allowed_ids(mask, len(VOCAB)))[0].tolist()


def test_prefill_and_decodes_carry_one_mask_per_row():
    sched, constrained, plain = scheduler(), request(1), request(2, None)
    sched.add(constrained)
    sched.add(plain)
    plan, _ = sched.next_plan()
    masks = {w.slot: w.grammar_masks for w in plan.work}
    assert allowed(masks[constrained.slot][0]) == [0, 4]  # ("a", "ab")
    assert masks[plain.slot] == ()
    constrained.generated.append(4)  # "ab" committed
    plain.generated.append(2)
    plan, _ = sched.next_plan()
    masks = {w.slot: w.grammar_masks for w in plan.work}
    assert allowed(masks[constrained.slot][0]) == [0, 2, 4]  # ("a", "c", "ab")


def test_a_speculative_round_keeps_the_proposals_the_grammar_accepts():
    sched = scheduler(speculative=3)
    r = request(1)
    sched.add(r)
    sched.next_plan()
    r.generated.extend([0, 1, 0, 1, 0])  # "ababa": history proposes b, a, b
    plan, _ = sched.next_plan()
    (work,) = plan.work
    assert work.proposals == r.proposals and len(work.grammar_masks) == 1 + len(work.proposals)
    assert work.proposals and all(p in (0, 1) for p in work.proposals)
    assert allowed(work.grammar_masks[0]) == [1]  # (after "ababa": only "b")
    r.generated.extend([1, 2])  # "abababc": the grammar may end; history proposes 0 ("a")
    plan, _ = sched.next_plan()
    (work,) = plan.work
    assert work.proposals == () and allowed(work.grammar_masks[0]) == [EOS]


def test_unservable_and_violating_requests_end_with_an_error_event():
    sched = scheduler()
    sched.grammars = None
    r = request(1)
    sched.add(r)
    assert r.done and isinstance(r.sink.events[-1], EngineError) and not sched.has_work()
    sched = scheduler()
    bad, good = request(1), request(2)
    sched.add(bad)
    sched.add(good)
    sched.next_plan()
    bad.generated.append(2)  # "c" first: not in the language
    good.generated.append(0)
    plan, _ = sched.next_plan()
    assert [w.slot for w in plan.work] == [good.slot]
    assert bad.done and isinstance(bad.sink.events[-1], EngineError)
    assert "does not match" in str(bad.sink.events[-1])
