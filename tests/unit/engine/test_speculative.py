"""Speculative decoding at TP1: history proposals, the commit's acceptance walk, and the
in-process engine with speculation on and off (tokens, logprobs, records, payload writes)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helios_logprobs.ranks.commit import RecordBatch, SlotState
from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.plan import RequestSpec, SlotWork
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.engine.proposer import HistoryProposer
from tests.checkpoints import write_qwen2
from tests.scripted_checkpoint import EOS, encode, write_scripted
from tests.spec_helpers import (
    JOBS,
    FrameWatch,
    assert_matches_transformers,
    assert_same_results,
    split_events,
)


# ------------------------------------------------------------------------------ proposer
def brute_force(context: list[int], k: int, lo: int, hi: int) -> tuple[int, ...]:
    """The longest suffix n-gram's earliest earlier occurrence with a following token."""
    length = len(context)
    for n in range(hi, lo - 1, -1):
        if length < n + 1:
            continue
        suffix = context[length - n :]
        for s in range(0, length - n):
            if context[s : s + n] == suffix:
                return tuple(context[s + n : min(s + n + k, length)])
    return ()


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 2), st.integers(1, 39))
def test_proposals_equal_brute_force_as_the_history_grows(tokens, k, lo, extra, split):
    proposer = HistoryProposer(k, lo, lo + extra)
    prompt, generated = tokens[:split], []
    for token in tokens[split:] + [None]:
        context = prompt + generated
        got = proposer.propose(1, prompt, generated, limit=k)
        assert got == brute_force(context, k, lo, lo + extra)
        if token is not None:
            generated.append(token)


def test_proposals_respect_the_limit_and_release():
    proposer = HistoryProposer(4, 1, 3)
    prompt = [1, 2, 3, 4, 5, 1, 2]
    assert proposer.propose(7, prompt, [], limit=10) == (3, 4, 5, 1)
    assert proposer.propose(7, prompt, [3], limit=2) == (4, 5)
    assert proposer.propose(7, prompt, [3], limit=0) == ()
    assert proposer.propose(8, [9, 8, 7], [], limit=4) == ()
    proposer.release(7)
    assert 7 not in proposer._indexes


# ---------------------------------------------------------------------- the commit walk
def slot_state(max_tokens: int = 10, stops: tuple[int, ...] = (), output=(),
               length: int = 8) -> SlotState:
    spec = RequestSpec(ordinal=1, max_tokens=max_tokens,
                       sampling=RowSampling(seed=1, position=0, temperature=0.0),
                       stop_token_ids=stops)
    return SlotState(epoch=1, spec=spec, prompt=[1, 2, 3], output=list(output), length=length)


@pytest.mark.parametrize("sampled, proposals, emitted, accepted, length", [
    ((5, 6, 7), (5, 6), [5, 6, 7], 2, 6),      # complete round: both accepted plus the bonus
    ((5, 9, 7), (5, 6), [5, 9], 1, 5),         # correction: the target's own token
    ((8, 6, 7), (5, 6), [8], 0, 4),            # first proposal rejected
    ((5, 6), (5,), [5, 6], 1, 5),              # width-one round, accepted
    ((4, 6), (5,), [4], 0, 4),                 # width-one round, rejected
    ((5,), (), [5], 0, 6),                     # ordinary sample
])
def test_walk_accepts_exactly_the_matching_prefix(sampled, proposals, emitted, accepted, length):
    # Prepared: 3 tokens cached before, 1 + N fed this round.
    state = slot_state(length=3 + 1 + len(proposals) if proposals else 6)
    batch = RecordBatch(abi6.record_width(8), submission=4)
    assert batch.emit(2, state, sampled, proposals, first_row=3) == len(emitted)
    row = batch.rows[0]
    kind = abi6.Kind.SPECULATIVE if proposals else abi6.Kind.SAMPLE
    assert row[abi6.KIND] == kind and row[abi6.FIRST_LOGIT_ROW] == 3
    assert row[abi6.OFFERED] == len(proposals) and row[abi6.ACCEPTED] == accepted
    assert row[abi6.HEADER : abi6.HEADER + row[abi6.EMITTED]] == emitted
    assert state.output == emitted and row[abi6.FORCED_MASK] == 0
    assert state.length == row[abi6.SEQUENCE_LENGTH] == length


def test_walk_clips_at_max_tokens_and_stop_ids_inside_the_accepted_run():
    state = slot_state(max_tokens=4, output=[1, 1])
    batch = RecordBatch(abi6.record_width(8), 0)
    assert batch.emit(0, state, (5, 6, 7, 8), (5, 6, 7), 0) == 2
    assert batch.rows[0][abi6.FINISH_REASON] == abi6.FinishReason.LENGTH
    assert batch.rows[0][abi6.ACCEPTED] == 1 and state.output == [1, 1, 5, 6]
    state = slot_state(stops=(6,))
    assert batch.emit(1, state, (5, 6, 7), (5, 6), 4) == 1
    row = batch.rows[1]
    assert row[abi6.FINISH_REASON] == abi6.FinishReason.STOP_TOKEN
    assert row[abi6.ACCEPTED] == 1 and row[abi6.HEADER + 1] == 6  # the stop id, not emitted


def test_slot_work_shape_of_a_round():
    SlotWork(0, 1, (4, 5, 6), 9, True, proposals=(5, 6))
    with pytest.raises(ValueError):
        SlotWork(0, 1, (4, 5, 7), 9, True, proposals=(5, 6))
    with pytest.raises(ValueError):
        SlotWork(0, 1, (4, 5, 6), 9, False, proposals=(5, 6))


def test_config_needs_room_for_a_round_in_one_record(tmp_path):
    with pytest.raises(ValueError, match="completion_token_capacity"):
        RuntimeConfig(model_dir=tmp_path, speculative_tokens=8)
    RuntimeConfig(model_dir=tmp_path, speculative_tokens=8, completion_token_capacity=9)
    with pytest.raises(ValueError, match="ngram"):
        RuntimeConfig(model_dir=tmp_path, ngram_min=3, ngram_max=2)


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def engine_for(model_dir, n: int, **overrides):
    config = RuntimeConfig(model_dir=model_dir, **{"capacity": 4, "max_model_len": 96,
                                                   "speculative_tokens": n, "ngram_min": 1,
                                                   "ngram_max": 3, **overrides})
    return build_engine(config, load_rank(config, None))




@pytest.fixture(scope="module")
def runs(qwen2):
    """Every job with N = 0, 2 and 4 (mixed batches: rounds, ordinary samples, opted-out and
    non-requesting slots share submissions), with the frame watches."""
    out = {}
    for n in (0, 2, 4):
        engine = engine_for(qwen2, n)
        watch = FrameWatch(engine.step)
        out[n] = (engine.run_offline(JOBS), watch, engine.speculation)
    return out


def test_speculation_changes_neither_tokens_nor_logprobs(runs, qwen2):
    base = runs[0][0]
    for n in (2, 4):
        assert_same_results(base, runs[n][0])
    for (prompt, params), events in zip(JOBS, runs[4][0], strict=True):
        tokens, finish = split_events(events)
        assert len(tokens) == params.max_tokens and finish.reason == "length"
        assert [t.index for t in tokens] == list(range(len(tokens)))
        assert_matches_transformers(qwen2, prompt, tokens, params)


def test_bad_words_inside_rounds_see_the_accepted_proposals(runs, qwen2):
    """A round's row i checks bad words against the output plus the proposals before it, so
    no banned sequence appears, and speculation on and off give the same tokens. The words
    are taken from the greedy output itself (repetitive: rounds accept proposals)."""
    from dataclasses import replace

    prompt, params = JOBS[0]

    def greedy(n: int, words: tuple) -> tuple[list[int], int]:
        engine = engine_for(qwen2, n)
        events = engine.run_offline([(prompt, replace(params, bad_words=words))])
        return [t.token_id for t in split_events(events[0])[0]], engine.speculation.accepted

    tokens = [t.token_id for t in split_events(runs[0][0][0])[0]]
    words: tuple = ((tokens[0], tokens[1]),)
    for _ in range(2):  # ban the output's next run of three equal tokens, twice
        out, _ = greedy(0, words)
        j = next(j for j in range(len(out) - 2) if out[j] == out[j + 1] == out[j + 2])
        words += (tuple(out[j : j + 3]),)
    off, _ = greedy(0, words)
    on, accepted = greedy(4, words)
    assert on == off and accepted > 0
    for word in words:
        assert all(tuple(on[j : j + len(word)]) != word for j in range(len(on)))


def test_rounds_accept_and_reject_and_records_agree(runs):
    assert not runs[0][1].rounds and not runs[0][2].rounds
    for n in (2, 4):
        _, watch, counters = runs[n]
        assert watch.problems == []
        offered, accepted = watch.counts()
        assert 0 < accepted < offered
        assert (counters.offered, counters.accepted) == (offered, accepted)
        assert max(len(p) for p, _ in watch.rounds) == n
        assert any(r[abi6.ACCEPTED] == len(p) for p, r in watch.rounds)  # bonus tokens
        assert any(r[abi6.ACCEPTED] == 0 for p, r in watch.rounds)       # corrections
        assert any(len(p) == 1 for p, _ in watch.rounds)                 # width-one rounds
        assert watch.samples > 0                                         # mixed batches


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """a -> b -> c -> a cycles; v -> w -> x -> y -> <eos> -> v."""
    return write_scripted(tmp_path_factory.mktemp("scripted"), {"c": "a", "y": EOS, EOS: "v"})


@pytest.mark.parametrize("text, params, emitted, finish", [
    ("abcabcab", dict(max_tokens=3), 3, "length"),      # max_tokens inside the accepted run
    ("abcabcab", dict(max_tokens=6), 6, "length"),
    ("vwxy<eos>vw", dict(max_tokens=9), 2, "stop"),     # EOS inside the accepted run
    ("abcabcab", dict(max_tokens=9, stop="a"), 1, "stop"),  # a stop id inside the run
])
def test_runs_end_inside_a_round_without_entries_past_the_end(scripted, text, params, emitted,
                                                              finish):
    prompt = encode(scripted, text)
    stop = params.pop("stop", None)
    stops = tuple(encode(scripted, stop)) if stop else ()
    sampling = SamplingParams(temperature=0.0, logprobs=3, stop_token_ids=stops, **params)
    results = {}
    for n in (0, 4):
        engine = engine_for(scripted, n, ngram_min=2)
        watch = FrameWatch(engine.step)
        results[n] = engine.run_offline([(prompt, sampling)])
        assert watch.problems == []
    tokens, end = split_events(results[4][0])
    assert len(tokens) == emitted and end.reason == finish
    assert all(t.logprob is not None for t in tokens)
    assert watch.rounds and watch.rounds[0][1][abi6.OFFERED] == 4
    assert_same_results(results[0], results[4])
    assert_matches_transformers(scripted, prompt, tokens, sampling)
