"""Shared by the speculative-decoding tests: running jobs on an engine, watching its frames,
and comparing results with each other and with transformers."""

from __future__ import annotations

import math

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.outputs import EngineError, Finished, GeneratedToken
from tests.checkpoints import hf_logprobs

SENTINEL = -7
TOL = 1e-4
"""Against transformers."""
SAME = 2e-5
"""Speculation on vs off: the same logits up to FP32 rounding of a wider forward (a round's
query rows attend as one block), so the same tokens and logprobs equal within this."""


SEEDED = dict(temperature=0.8, top_k=50, top_p=0.9, seed=11, repetition_penalty=1.2,
              presence_penalty=0.3, frequency_penalty=0.2)
JOBS = [
    ([5, 6, 7, 8] * 3 + [5, 6], SamplingParams(max_tokens=20, temperature=0.0, logprobs=20)),
    ([3, 9, 27, 81] * 3, SamplingParams(max_tokens=16, logprobs=5, **SEEDED)),
    ([11, 12, 11, 12, 11], SamplingParams(max_tokens=18, temperature=0.0,
                                          logprob_token_ids=(300, 0, 7, 150, 12))),
    ([40, 41, 40, 41], SamplingParams(max_tokens=14, temperature=0.7, seed=5)),
    ([7, 7, 7], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, speculative=False)),
    ([9, 8, 9, 8, 9], SamplingParams(max_tokens=15, temperature=1.0, seed=3, min_p=0.05,
                                     logprobs=0)),
]
JOBS = [(p, SamplingParams(**{**vars(s), "ignore_eos": True})) for p, s in JOBS]
"""Greedy and seeded jobs for the random Qwen2 (vocabulary 301) with repetition in the
prompts: K=20, K=5, selected ids, no logprobs, opted out, K=0."""


class FrameWatch:
    """Wraps ``step.run``: before each submission the active frame's payload is filled with a
    sentinel; after it, every sampling slot's record is checked against its work item, and
    the payload must be written exactly at the requesting slots' emitted, unforced
    positions (nothing past the committed prefix, nothing for other slots)."""

    def __init__(self, step) -> None:
        self.step = step
        self.rounds: list[tuple[tuple[int, ...], list[int]]] = []
        """(proposals, record) of every speculative round."""
        self.samples = 0
        self.problems: list[str] = []
        run = step.run

        def watched(plan):
            step.outputs.completion_logprobs[plan.frame].fill_(SENTINEL)
            run(plan)
            self.check(plan)

        step.run = watched

    def check(self, plan) -> None:
        records = self.step.outputs.completion_records[plan.frame]
        payload = self.step.outputs.completion_logprobs[plan.frame]
        requesting = set(self.step.upload.requesting_slots)
        for work in plan.work:
            if not work.samples:
                continue
            record = records[work.slot].tolist()
            emitted = record[abi6.EMITTED]
            self.problems += record_problems(work, record)
            if work.proposals:
                self.rounds.append((work.proposals, record))
            else:
                self.samples += 1
            for pos in range(payload.shape[1]):
                wanted = (work.slot in requesting and pos < emitted
                          and not (record[abi6.FORCED_MASK] >> pos) & 1)
                written = int(payload[work.slot, pos, 0]) != SENTINEL
                if written != wanted:
                    self.problems.append(f"slot {work.slot} position {pos}: written={written}, "
                                         f"emitted={emitted}, requesting={wanted}")
        for slot in range(payload.shape[0]):
            if slot not in requesting and bool((payload[slot] != SENTINEL).any()):
                self.problems.append(f"slot {slot}: payload written without a request")

    def counts(self) -> tuple[int, int]:
        """(offered, accepted) over the rounds seen."""
        return (sum(r[abi6.OFFERED] for _, r in self.rounds),
                sum(r[abi6.ACCEPTED] for _, r in self.rounds))


def record_problems(work, record: list[int]) -> list[str]:
    """A committed record against the round (or sample) the plan asked for."""
    where = f"slot {work.slot} submission {record[abi6.SUBMISSION]}"
    proposals = work.proposals
    kind = abi6.Kind.SPECULATIVE if proposals else abi6.Kind.SAMPLE
    emitted, accepted = record[abi6.EMITTED], record[abi6.ACCEPTED]
    tokens = record[abi6.HEADER : abi6.HEADER + emitted]
    finish = abi6.FinishReason(record[abi6.FINISH_REASON])
    problems = []
    if record[abi6.KIND] != kind or record[abi6.OFFERED] != len(proposals):
        problems.append(f"{where}: kind {record[abi6.KIND]} offered {record[abi6.OFFERED]}")
    if tokens[:accepted] != list(proposals[:accepted]):
        problems.append(f"{where}: accepted {accepted} but tokens {tokens} vs {proposals}")
    stopped = finish in (abi6.FinishReason.STOP_TOKEN, abi6.FinishReason.EOS)
    if emitted != accepted + (0 if stopped else 1):
        problems.append(f"{where}: emitted {emitted}, accepted {accepted}, finish {finish!r}")
    ended = finish != abi6.FinishReason.NONE
    if accepted < len(proposals) and not ended and tokens[accepted] == proposals[accepted]:
        problems.append(f"{where}: a matching proposal was rejected")
    if proposals and record[abi6.SEQUENCE_LENGTH] != work.start + 1 + accepted:
        problems.append(f"{where}: cache length {record[abi6.SEQUENCE_LENGTH]}, expected "
                        f"{work.start + 1 + accepted}")
    return problems


def split_events(events: list) -> tuple[list[GeneratedToken], Finished]:
    errors = [e for e in events if isinstance(e, EngineError)]
    assert not errors, errors
    assert isinstance(events[-1], Finished), events[-1]
    return [e for e in events if isinstance(e, GeneratedToken)], events[-1]


def assert_same_results(a: list, b: list) -> None:
    """Two runs of the same jobs: identical tokens, finishes and ids; logprobs within SAME."""
    for events_a, events_b in zip(a, b, strict=True):
        (ta, fa), (tb, fb) = split_events(events_a), split_events(events_b)
        assert [t.token_id for t in ta] == [t.token_id for t in tb]
        assert fa == fb
        for x, y in zip(ta, tb, strict=True):
            assert x.index == y.index
            assert (x.logprob is None) == (y.logprob is None)
            if x.logprob is not None:
                assert math.isclose(x.logprob, y.logprob, abs_tol=SAME)
            assert [p.token_id for p in x.alternatives] == [p.token_id for p in y.alternatives]
            for p, q in zip(x.alternatives, y.alternatives, strict=True):
                assert math.isclose(p.logprob, q.logprob, abs_tol=SAME)


def assert_matches_transformers(model_dir, prompt: list[int], tokens, params) -> None:
    """Every entry is the transformers FP32 log-softmax of the emitted sequence."""
    ref = hf_logprobs(model_dir, prompt + [t.token_id for t in tokens])
    for t in tokens:
        row = ref[len(prompt) + t.index - 1]
        if t.logprob is None:
            continue
        assert math.isclose(t.logprob, float(row[t.token_id]), abs_tol=TOL)
        values = [a.logprob for a in t.alternatives]
        for a in t.alternatives:
            assert math.isclose(a.logprob, float(row[a.token_id]), abs_tol=TOL)
        if params.logprob_token_ids:
            assert [a.token_id for a in t.alternatives] == list(params.logprob_token_ids)
        else:
            assert len(values) == params.logprobs
            assert values == sorted(values, reverse=True)
            if values:
                must = {i for i, v in enumerate(row.tolist()) if v > values[-1] + TOL}
                assert must <= {a.token_id for a in t.alternatives}
