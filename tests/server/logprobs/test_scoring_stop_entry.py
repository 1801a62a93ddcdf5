"""Scoring requests (Completions echo with logprobs) report an entry for every generated token,
a terminating EOS or stop token included, as vLLM does (issue 39): lm-evaluation-harness reads
`token_logprobs[ctxlen:-1]`, taking the last entry for the generated token's, so a missing EOS
entry silently drops the continuation's last token. The checkpoint is scripted (greedy "c" ->
EOS), at TP1 and TP2; values against transformers' FP32 log_softmax, token strings against
the tokenizer's own decode of the single id (vLLM's convert_ids_list_to_tokens)."""

from __future__ import annotations

import math

import pytest

from tests.checkpoints import hf_logprobs
from tests.scripted_checkpoint import EOS, encode, write_scripted
from tests.server.helpers import TOLERANCE, hf_tokenizer, launch, post, sse_events, strict_json
from tests.server.logprobs.scoring import hf_continuation, lm_eval_parse_logprobs, scoring_body

pytestmark = pytest.mark.slow

TPS = (1, 2)
CASES = [("ab", "c"), ("xy", "zabc"), ("ab", "q"), ("mn", "op")]
"""(context, continuation): after "c" the scripted model's greedy token is EOS."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring_stop_entry")
    model_dir = write_scripted(root / "model", {"c": EOS})
    started = {tp: launch(f"scoring_stop_entry_tp{tp}", model_dir, tp,
                          ["--capacity", "4", "--prompt-logprobs"], root) for tp in TPS}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def completion(server, body: dict) -> dict:
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return strict_json(response.content)


def streamed(server, body: dict) -> tuple[str, dict, list]:
    """The stream's text and logprobs arrays joined over its chunks, and its finish chunk."""
    response = post(server, "/v1/completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    text, joined, finishes = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": []}, []
    for event in sse_events(response):
        for choice in event["choices"]:
            text += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                joined[key] += values
            if choice["finish_reason"] is not None:
                finishes.append(choice)
    return text, joined, finishes


def ids(server, text: str) -> list[int]:
    return encode(server.model_dir, text)


@pytest.mark.parametrize("tp", TPS)
def test_lm_eval_slice_equals_transformers_when_the_next_token_is_eos(servers, tp):
    server = servers[tp]
    eos = ids(server, EOS)[0]
    cases = [(ids(server, c), ids(server, x)) for c, x in CASES]
    body = scoring_body(server.model_dir.name, [c + x for c, x in cases])
    out = completion(server, body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    ends_at_eos = 0
    for (context, continuation), choice in zip(cases, choices, strict=True):
        want, want_greedy, nxt = hf_continuation(server.model_dir, context, continuation)
        got, greedy = lm_eval_parse_logprobs(choice, len(context))
        assert abs(got - want) <= TOLERANCE * len(continuation), (context, continuation)
        assert greedy == want_greedy
        # entries = prompt tokens + completion tokens (one: max_tokens 1)
        assert len(choice["logprobs"]["token_logprobs"]) == len(context) + len(continuation) + 1
        ends_at_eos += nxt == eos
        if nxt == eos:
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert ends_at_eos == 2
    assert out["usage"]["completion_tokens"] == len(CASES)


@pytest.mark.parametrize("tp", TPS)
def test_eos_entry_value_token_offset_and_text(servers, tp):
    """The EOS entry: transformers' value, the tokenizer's decode of the id as its token
    string, at the end of the text, which leaves the EOS out (skip_special_tokens or not)."""
    server = servers[tp]
    eos, prompt = ids(server, EOS)[0], ids(server, "ab")
    rows = hf_logprobs(server.model_dir, [*prompt, *ids(server, "c")])  # row i predicts i + 1
    eos_string = hf_tokenizer(server.model_dir).decode([eos])
    for skip in (True, False):
        body = {"model": server.model_dir.name, "prompt": "ab", "echo": True, "logprobs": 2,
                "max_tokens": 5, "temperature": 0, "skip_special_tokens": skip}
        out = completion(server, body)
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == "abc" and choice["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == 2  # "c" and EOS, as vLLM counts
        assert len(lp["tokens"]) == len(prompt) + 2
        assert lp["tokens"][-2:] == ["c", eos_string]
        assert lp["text_offset"] == [0, 1, 2, 3]
        assert math.isclose(lp["token_logprobs"][-1], float(rows[-1, eos]), abs_tol=TOLERANCE)
        assert math.isclose(lp["token_logprobs"][-2], float(rows[-2, ids(server, "c")[0]]),
                            abs_tol=TOLERANCE)
        top = lp["top_logprobs"][-1]
        assert len(top) == 2 and math.isclose(top[eos_string], lp["token_logprobs"][-1])


@pytest.mark.parametrize("tp", TPS)
def test_streaming_echo_agrees_with_the_whole_response(servers, tp):
    server = servers[tp]
    for context, continuation in CASES[:2]:
        body = {"model": server.model_dir.name, "prompt": context + continuation,
                "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
        whole = completion(server, body)["choices"][0]
        text, joined, finishes = streamed(server, body)
        assert text == whole["text"] == context + continuation
        assert len(finishes) == 1 and finishes[0]["finish_reason"] == "stop"
        assert joined["tokens"] == whole["logprobs"]["tokens"]
        assert joined["text_offset"] == whole["logprobs"]["text_offset"]
        for a, b in zip(joined["token_logprobs"][1:], whole["logprobs"]["token_logprobs"][1:],
                        strict=True):
            assert math.isclose(a, b, abs_tol=1e-5)
        assert len(joined["tokens"]) == len(context + continuation) + 1


@pytest.mark.parametrize("tp", TPS)
def test_include_stop_str_keeps_the_eos_text_and_its_entry_starts_it(servers, tp):
    server = servers[tp]
    body = {"model": server.model_dir.name, "prompt": "ab", "echo": True, "logprobs": 0,
            "max_tokens": 5, "temperature": 0, "skip_special_tokens": False,
            "include_stop_str_in_output": True}
    choice = completion(server, body)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == f"abc{EOS}"
    assert lp["text_offset"] == [0, 1, 2, 3] and len(lp["token_logprobs"]) == 4


@pytest.mark.parametrize("tp", TPS)
def test_a_stop_token_id_has_an_entry_and_no_text(servers, tp):
    server = servers[tp]
    c = ids(server, "c")[0]
    prompt = ids(server, "ab")
    body = {"model": server.model_dir.name, "prompt": prompt, "echo": True, "logprobs": 1,
            "max_tokens": 4, "temperature": 0, "stop_token_ids": [c]}
    out = completion(server, body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "ab"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", c)
    assert lp["tokens"] == ["a", "b", "c"] and lp["text_offset"] == [0, 1, 2]
    rows = hf_logprobs(server.model_dir, prompt)  # row i predicts i + 1
    assert math.isclose(lp["token_logprobs"][-1], float(rows[-1, c]), abs_tol=TOLERANCE)
    assert out["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("tp", TPS)
def test_other_requests_keep_the_contract_rule(servers, tp):
    """Without echo a terminating EOS has no entry (the contract); prompt_logprobs holds the
    prompt's positions whatever ends the generation, equal to the echoed ones."""
    server = servers[tp]
    prompt = ids(server, "xyzab")
    plain = completion(server, {"model": server.model_dir.name, "prompt": prompt,
                                "logprobs": 1, "max_tokens": 5, "temperature": 0})
    choice = plain["choices"][0]
    assert choice["text"] == "c" and choice["logprobs"]["tokens"] == ["c"]
    assert plain["usage"]["completion_tokens"] == 2
    body = {"model": server.model_dir.name, "prompt": prompt, "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    scored = completion(server, {**body, "prompt": ids(server, "xyzabc")})["choices"][0]
    scores = scored["prompt_logprobs"]
    assert len(scores) == 6 and scores[0] is None
    echoed = scored["logprobs"]["token_logprobs"]
    assert len(echoed) == 7
    for position, (entry, value) in enumerate(zip(scores[1:], echoed[1:6], strict=True), 1):
        token = ids(server, "xyzabc")[position]
        assert math.isclose(entry[str(token)]["logprob"], value, abs_tol=1e-6)
