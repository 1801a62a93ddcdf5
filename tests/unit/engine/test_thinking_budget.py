"""Thinking budgets at TP1: reasoning delimiters, forced end strings (token by token), forced
positions without logprob entries, and the same results with speculation on and off."""

from __future__ import annotations

import pytest

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.text.reasoning import reasoning_strings, resolve_tokens
from tests.scripted_checkpoint import (
    END_THINK,
    THINK,
    build_tokenizer,
    decode,
    encode,
    write_scripted,
)
from tests.spec_helpers import (
    FrameWatch,
    assert_matches_transformers,
    assert_same_results,
    split_events,
)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """a -> b -> c -> a cycles; k -> l -> m -> <think> -> a; </think> -> newline -> 0 -> 1..."""
    return write_scripted(tmp_path_factory.mktemp("scripted"), {"c": "a", "m": THINK})


def engine_for(model_dir, n: int = 0, **overrides):
    config = RuntimeConfig(model_dir=model_dir, **{
        "capacity": 3, "max_model_len": 64, "speculative_tokens": n, "ngram_min": 2,
        "ngram_max": 3, "reasoning_parser": "qwen3", **overrides})
    return build_engine(config, load_rank(config, None))


def run(model_dir, text: str, n: int = 0, **params):
    """(tokens, finish, watch) of one greedy request with logprobs."""
    engine = engine_for(model_dir, n, **params.pop("engine", {}))
    watch = FrameWatch(engine.step)
    sampling = SamplingParams(temperature=0.0, logprobs=2, **params)
    (events,) = engine.run_offline([(encode(model_dir, text), sampling)])
    assert watch.problems == []
    tokens, finish = split_events(events)
    return tokens, finish, watch, events


def forced_positions(watch: FrameWatch) -> int:
    records = [r for _, r in watch.rounds]
    return sum(bin(r[abi6.FORCED_MASK]).count("1") for r in records)


# ------------------------------------------------------------------------ delimiters
def test_reasoning_strings_from_parsers_and_overrides():
    for parser in ("qwen3", "deepseek_r1"):
        strings = reasoning_strings(parser, None)
        assert (strings.start, strings.end) == ("<think>", "</think>")
    override = reasoning_strings("qwen3", {"reasoning_end_str": "done"})
    assert (override.start, override.end) == ("<think>", "done")
    assert reasoning_strings(None, None) is None
    for parser, config in (("nope", None), (None, {"reasoning_end_str": "x"}),
                           (None, {"reasoning_start": "a", "reasoning_end_str": "b"})):
        with pytest.raises(ValueError):
            reasoning_strings(parser, config)
    tokens = resolve_tokens(reasoning_strings("qwen3", {"reasoning_end_str": "done"}),
                            build_tokenizer())
    assert len(tokens.start) == 1 and len(tokens.end) == 4


def test_budget_needs_a_reasoning_configuration(scripted):
    engine = engine_for(scripted, reasoning_parser=None)
    for budget in (3, 0):
        with pytest.raises(RequestError) as err:
            engine.check([1, 2], SamplingParams(thinking_token_budget=budget))
        assert err.value.param == "thinking_token_budget"
    engine = engine_for(scripted)
    for budget in (-1, True, 2.0):
        with pytest.raises(RequestError) as err:
            engine.check([1, 2], SamplingParams(thinking_token_budget=budget))
        assert err.value.param == "thinking_token_budget"


# ---------------------------------------------------------------------------- forcing
def test_spent_budget_forces_the_end_token_without_an_entry(scripted):
    tokens, finish, watch, _ = run(scripted, f"q{THINK}ab", max_tokens=8,
                                   thinking_token_budget=4)
    text = decode(scripted, [t.token_id for t in tokens])
    assert text == f"ca{END_THINK}\n0123"  # a, b in the prompt + c, a: four tokens
    assert [t.logprob is None for t in tokens] == [False, False, True] + [False] * 5
    assert tokens[2].alternatives == () and finish.reason == "length"
    assert_matches_transformers(scripted, encode(scripted, f"q{THINK}ab"), tokens,
                                SamplingParams(logprobs=2))


def test_multi_token_end_string_is_forced_token_by_token(scripted):
    tokens, _, _, _ = run(scripted, f"{THINK}", max_tokens=10, thinking_token_budget=3,
                          engine={"reasoning_config": {"reasoning_end_str": "done"}})
    text = decode(scripted, [t.token_id for t in tokens])
    assert text == "abcdonefgh"
    assert [t.logprob is None for t in tokens] == [False] * 3 + [True] * 4 + [False] * 3


def test_budget_zero_and_spans_opened_by_the_output(scripted):
    tokens, _, _, _ = run(scripted, f"x{THINK}", max_tokens=3, thinking_token_budget=0)
    assert decode(scripted, [t.token_id for t in tokens]) == f"{END_THINK}\n0"
    tokens, _, _, _ = run(scripted, "k", max_tokens=7, thinking_token_budget=2)
    assert decode(scripted, [t.token_id for t in tokens]) == f"lm{THINK}ab{END_THINK}\n"
    assert sum(t.logprob is None for t in tokens) == 1
    tokens, _, _, _ = run(scripted, "ab", max_tokens=5, thinking_token_budget=0)
    assert decode(scripted, [t.token_id for t in tokens]) == "cabca"  # no span: nothing forced


def test_forcing_inside_a_round_equals_speculation_off(scripted):
    text = f"x{THINK}abcab"  # five thinking tokens in the prompt
    results = {n: run(scripted, text, n, max_tokens=12, thinking_token_budget=8)
               for n in (0, 4)}
    tokens, _, watch, _ = results[4]
    assert decode(scripted, [t.token_id for t in tokens]) == f"cab{END_THINK}\n0123456"
    assert_same_results([results[0][3]], [results[4][3]])
    # After the prefill's sample (c), the first round proposes a, b, c (the history after
    # "abc"); a and b are accepted, then the budget is spent: position 2 is forced to
    # </think>, which rejects the proposal c (a forced correction).
    proposals, first = watch.rounds[0]
    assert len(proposals) == 3 and first[abi6.FORCED_MASK] == 1 << 2
    assert first[abi6.EMITTED] == 3 and first[abi6.ACCEPTED] == 2
    entries = sum(t.logprob is not None for t in tokens)
    assert entries == len(tokens) - forced_positions(watch) == len(tokens) - 1


def test_threaded_engine_with_budget_and_concurrent_requests(scripted):
    engine = engine_for(scripted, 2).start()
    try:
        prompts = [f"q{THINK}ab", "k", "abcab"]
        params = SamplingParams(temperature=0.0, max_tokens=8, thinking_token_budget=2,
                                logprobs=1)
        outs = [engine.generate_sync(encode(scripted, p), params) for p in prompts]
    finally:
        engine.shutdown()
    texts = [decode(scripted, [t.token_id for t in toks]) for toks, _ in outs]
    assert texts == [f"{END_THINK}\n012345", f"lm{THINK}ab{END_THINK}\n0", "cabcabca"]
