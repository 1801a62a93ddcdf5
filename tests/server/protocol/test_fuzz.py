"""Schema fuzzing of the running server: generated bodies for /v1/completions and
/v1/chat/completions (valid, malformed and adversarial values for every field) never get a
5xx nor leave the engine unhealthy, and every answer is strict JSON (no NaN or Infinity): a
200 has choices (or, streamed, SSE events ending in [DONE]; the Responses API's typed
events), an error has vLLM's error object naming a message."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.helpers import response_events, sse_events, strict_json

pytestmark = pytest.mark.slow

ERRORS = {400, 404, 413, 422, 429}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False), st.text(max_size=8))
IDS = st.lists(st.one_of(st.integers(-3, 330), st.integers(-(2**66), 2**66), st.booleans(),
                         st.floats(-2, 400, allow_nan=False)), max_size=6)
FIELDS = {
    "max_tokens": st.one_of(st.integers(-2, 6), SCALARS),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), SCALARS),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), SCALARS),
    "top_k": st.one_of(st.integers(-2, 400), SCALARS),
    "min_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), SCALARS),
    "n": st.one_of(st.integers(-1, 3), SCALARS),
    "seed": SCALARS,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), SCALARS),
    "stop_token_ids": st.one_of(IDS, SCALARS),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=5), SCALARS, max_size=3),
                            st.dictionaries(st.integers(-5, 400).map(str),
                                            st.floats(-200, 200, allow_nan=False), max_size=3),
                            SCALARS),
    "presence_penalty": st.one_of(st.floats(-3, 3, allow_nan=False), SCALARS),
    "frequency_penalty": st.one_of(st.floats(-3, 3, allow_nan=False), SCALARS),
    "repetition_penalty": st.one_of(st.floats(-1, 3, allow_nan=False), SCALARS,
                                    st.sampled_from([5e-324, 1e-300, 1e300, 1.7e308])),
    "allowed_token_ids": st.one_of(IDS, SCALARS),
    "ignore_eos": st.one_of(st.booleans(), SCALARS),
    "min_tokens": st.one_of(st.integers(-1, 8), SCALARS),
    "logprob_token_ids": st.one_of(IDS, SCALARS),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({}, optional={
        "include_usage": SCALARS, "continuous_usage_stats": SCALARS}), SCALARS),
    "skip_special_tokens": st.one_of(st.booleans(), SCALARS),
    "return_tokens_as_token_ids": st.one_of(st.booleans(), SCALARS),
    "speculative": st.one_of(st.booleans(), SCALARS),
    "thinking_token_budget": st.one_of(st.integers(-1, 4), SCALARS),
    "bad_words": st.one_of(st.lists(st.text(max_size=6), max_size=3), SCALARS),
    "truncate_prompt_tokens": st.one_of(st.integers(-2, 6), SCALARS),
    "truncation_side": st.one_of(st.sampled_from(["left", "right", "middle"]), SCALARS),
    "return_token_ids": st.one_of(st.booleans(), SCALARS),
}
COMPLETION_FIELDS = {
    **FIELDS,
    "prompt": st.one_of(st.text(max_size=12), IDS, st.lists(st.text(max_size=6), max_size=3),
                        st.lists(IDS, max_size=2), SCALARS),
    "logprobs": st.one_of(st.integers(-2, 25), SCALARS),
    "echo": st.one_of(st.booleans(), SCALARS),
    "prompt_logprobs": st.one_of(st.integers(-2, 25), SCALARS),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                 "content": st.one_of(st.text(max_size=10), SCALARS)})
CHAT_FIELDS = {
    **FIELDS,
    "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(SCALARS),
                          SCALARS),
    "logprobs": st.one_of(st.booleans(), SCALARS),
    "top_logprobs": st.one_of(st.integers(-2, 25), SCALARS),
}


PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "image"]),
                              "text": st.one_of(st.text(max_size=8), SCALARS)})
RESPONSES_FIELDS = {
    "input": st.one_of(
        st.text(max_size=12),
        st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "x"]),
             "content": st.one_of(st.text(max_size=8), st.lists(PART, max_size=2), SCALARS)},
            optional={"type": st.sampled_from(["message", "function_call"])}), max_size=3),
        SCALARS),
    "instructions": st.one_of(st.text(max_size=8), SCALARS),
    "max_output_tokens": st.one_of(st.integers(-1, 6), SCALARS),
    "temperature": FIELDS["temperature"],
    "top_p": FIELDS["top_p"],
    "top_logprobs": st.one_of(st.integers(-2, 25), SCALARS),
    "include": st.one_of(st.just(["message.output_text.logprobs"]),
                         st.lists(st.text(max_size=8), max_size=2), SCALARS),
    "stream": st.booleans(),
    "tools": st.one_of(st.just([]), st.lists(SCALARS, max_size=1), SCALARS),
    "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object"])})}), SCALARS),
    "previous_response_id": st.one_of(st.none(), st.text(max_size=5)),
    "seed": SCALARS,
}


def bodies(fields: dict, required: str):
    optional = {k: v for k, v in fields.items() if k != required}
    return st.fixed_dictionaries({required: fields[required]}, optional=optional)


def check(response: httpx.Response, stream: bool, events_of=sse_events) -> None:
    assert response.status_code < 500, response.text[:2000]
    if response.status_code != 200:
        assert response.status_code in ERRORS, response.status_code
        error = strict_json(response.content)["error"]
        assert isinstance(error["message"], str) and error["message"]
        return
    if stream:
        events = events_of(response)
        assert events and all("error" not in e and e.get("type") != "error"
                              for e in events), events[-1:]
    else:
        body = strict_json(response.content)
        assert body["choices"] if "choices" in body else body["output"]


def send(server, path: str, body: dict) -> httpx.Response:
    """The answer to ``body``, after which the engine must still be healthy: a body that
    stops it is reported itself (and shrunk), not as the 503s of the examples after it."""
    body = {"model": server.model_dir.name, **body}
    for key in ("max_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and body[key] > 6:
            body[key] = 6
    response = httpx.post(server.url + path, content=json.dumps(body), timeout=120.0,
                          headers={"content-type": "application/json"})
    assert httpx.get(server.url + "/health", timeout=30.0).status_code == 200, body
    return response


FUZZ = settings(max_examples=int(os.environ.get("HELIOS_FUZZ_EXAMPLES", "120")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(bodies(COMPLETION_FIELDS, "prompt"))
def test_completions_never_fail_with_5xx(server, body):
    check(send(server, "/v1/completions", body), body.get("stream") is True)


@FUZZ
@given(bodies(CHAT_FIELDS, "messages"))
def test_chat_completions_never_fail_with_5xx(server, body):
    check(send(server, "/v1/chat/completions", body), body.get("stream") is True)


@FUZZ
@given(bodies(RESPONSES_FIELDS, "input"))
def test_responses_never_fail_with_5xx(server, body):
    check(send(server, "/v1/responses", body), body.get("stream") is True, response_events)


EDGE_PENALTIES = st.sampled_from([5e-324, 1e-300, 1e-45, 1e300, 1.7e308])
LANES = st.integers(0, 255)  # (the byte-level model has more than 256 ids)
VALID_SAMPLING = st.fixed_dictionaries({"prompt": st.lists(LANES, min_size=1, max_size=6)},
                                        optional={
    "temperature": st.one_of(st.just(0.0), st.floats(0.01, 2.0)),
    "top_p": st.one_of(st.just(5e-324), st.floats(0.01, 1.0)),
    "top_k": st.integers(-1, 300),
    "min_p": st.floats(0.0, 1.0),
    "repetition_penalty": st.one_of(EDGE_PENALTIES, st.floats(0.01, 5.0)),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(LANES.map(str), st.floats(-100.0, 100.0), max_size=4),
    "allowed_token_ids": st.lists(LANES, min_size=1, max_size=5, unique=True),
    "min_tokens": st.integers(0, 3),
    "logprobs": st.integers(0, 20),
    "seed": st.integers(0, 2**32),
}).map(lambda body: {"logprobs": 0, **body})


@FUZZ
@given(VALID_SAMPLING)
def test_valid_sampling_parameters_are_served_from_the_allowed_ids(server, body):
    """Every body here is valid (edges of float32 included, which round to 0 or inf there), so
    each one is served: a 200 whose tokens are all allowed ids and whose logprobs are numbers."""
    body = {**body, "max_tokens": 3, "ignore_eos": True, "return_tokens_as_token_ids": True}
    if body.get("temperature") == 0.0:
        body.pop("seed", None)
    response = send(server, "/v1/completions", body)
    assert response.status_code == 200, (body, response.text[:2000])
    logprobs = strict_json(response.content)["choices"][0]["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    assert len(ids) == 3 and all(0 <= t for t in ids)
    if "allowed_token_ids" in body:
        assert set(ids) <= set(body["allowed_token_ids"]), (body, ids)
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"])
