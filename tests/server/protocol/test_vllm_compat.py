"""Assertions of vLLM's own server tests (tests/entrypoints/openai/) that this server failed,
replayed with the official `openai` client: stream_options defaults, the refusals' wording that
vLLM's clients and tests match, every bad logit_bias key named at once; and what vLLM's request
validators and SamplingParams refuse or accept (its protocol.py and sampling_params.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import post, served_name, strict_json

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def _completion_chunks(server, stream_options: dict) -> list:
    client = server.client()
    return list(client.completions.create(
        model=served_name(server), prompt="What is the capital of France?", max_tokens=5,
        temperature=0.0, stream=True, stream_options=stream_options,
        extra_body={"ignore_eos": True}))


def _chat_chunks(server, stream_options: dict) -> list:
    client = server.client()
    return list(client.chat.completions.create(
        model=served_name(server), messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
        stream=True, stream_options=stream_options, extra_body={"ignore_eos": True}))


@pytest.mark.parametrize("stream_options", [
    {},  # vLLM's StreamOptions.include_usage defaults to False (test_completion_stream_options)
    {"include_usage": False, "continuous_usage_stats": True},  # per-chunk usage needs both
    {"include_usage": False},
])
@pytest.mark.parametrize("chunks_of", [_completion_chunks, _chat_chunks])
def test_stream_options_without_include_usage_send_no_usage(server, stream_options, chunks_of):
    chunks = chunks_of(server, stream_options)
    assert chunks and all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


@pytest.mark.parametrize("chunks_of", [_completion_chunks, _chat_chunks])
def test_include_usage_with_continuous_stats_still_reports(server, chunks_of):
    chunks = chunks_of(server, {"include_usage": True, "continuous_usage_stats": True})
    assert all(chunk.usage is not None for chunk in chunks)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert final.usage.total_tokens == final.usage.prompt_tokens + 5


def test_logit_bias_names_every_bad_key(server):
    """test_chat_logit_bias_multiple_non_integer_keys: both keys in one 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=served_name(server), messages=MESSAGES, max_tokens=5,
            logit_bias={"bad1": 50.0, "bad2": 20.0})
    error = caught.value
    assert error.status_code == 400 and error.body["param"] == "logit_bias"
    assert "bad1" in error.message and "bad2" in error.message


@pytest.mark.parametrize("seed, kind", [(-(2**63) - 1, "greater_than_equal"),
                                        (2**63, "less_than_equal")])
def test_seed_out_of_int64_names_the_pydantic_error_type(server, seed, kind):
    """test_chat.py::test_long_seed matches pydantic's error type in the message."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=served_name(server), messages=MESSAGES, temperature=0, seed=seed)
    assert caught.value.body["param"] == "seed"
    assert kind in caught.value.message


EMPTY = "Either prompt or prompt_embeds must be provided and non-empty."


@pytest.mark.parametrize("prompt", ["", [], [[]], [[1, 2], []], [""], None, "absent"])
def test_empty_or_missing_prompt_uses_vllm_wording(server, prompt):
    """test_prompt_validation.py / test_empty_prompt_list.py match this sentence."""
    body = {"model": served_name(server), "max_tokens": 2}
    if prompt != "absent":
        body["prompt"] = prompt
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = strict_json(response.content)["error"]
    assert error == {"message": EMPTY, "type": "BadRequestError", "param": "prompt", "code": 400}


@pytest.mark.parametrize("prompt", [[999_999], [5, -1]])
def test_out_of_vocabulary_prompt_ids_use_vllm_wording(server, prompt):
    """test_prompt_validation.py::test_out_of_vocab_token_ids matches "out of vocabulary"."""
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as info:
        server.client().completions.create(model=served_name(server), prompt=prompt,
                                           max_tokens=2)
    assert info.value.body["param"] == "prompt"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
# (route, fields, param, what vLLM's message says): vLLM's request validators
# (completion/ and chat_completion/protocol.py) and SamplingParams._verify_args.
REFUSED_AS_VLLM = [
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ("completions", {"presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2, 2], got 3.0."),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty",
     "frequency_penalty must be in [-2, 2], got -2.5."),
    ("completions", {"temperature": 3}, "temperature", "temperature must be in [0, 2], got 3.0."),
    ("completions", {"temperature": -0.5}, "temperature",
     "temperature must be non-negative, got -0.5."),
    ("completions", {"n": 2, "temperature": 0}, "n",
     "n must be 1 when using greedy sampling, got 2."),
    ("completions", {"stop": [""]}, "stop", "stop cannot contain an empty string."),
    ("completions", {"stop": ""}, "stop", "stop cannot contain an empty string."),
    ("completions", {"bad_words": [""]}, "bad_words", "bad_words cannot contain an empty string."),
    ("completions", {"stream_interval": 0}, "stream_interval",
     "stream_interval must be at least 1, got 0."),
    ("completions", {"cache_salt": ""}, "cache_salt",
     "Parameter 'cache_salt' must be a non-empty string if provided."),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    ("completions", {"logprobs": -2}, "logprobs", "`logprobs` must be a positive value or -1."),
    ("completions", {"logprobs": 21}, "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("completions", {"logprobs": -1}, "logprobs", "Requested sample logprobs of "),
    ("completions", {"logprobs": 0, "logprob_token_ids": []}, "logprob_token_ids",
     "`logprob_token_ids` must not be an empty list."),
    ("completions", {"logprob_token_ids": []}, "logprob_token_ids",
     "`logprob_token_ids` must not be an empty list."),
    ("completions", {"logprob_token_ids": [5]}, "logprob_token_ids",
     "when using `logprob_token_ids`, `logprobs` must be set."),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be >= 1"),
    ("completions", {"prompt": None, "prompt_embeds": []}, "prompt", EMPTY),
    ("chat", {"tool_choice": "auto"}, "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    ("chat", {"tools": []}, "tools", "`tools` must not be an empty array."),
    ("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice",
     "Invalid value for `tool_choice`: sometimes!"),
    ("chat", {"top_logprobs": 3}, "top_logprobs",
     "when using `top_logprobs`, `logprobs` must be set to true."),
    ("chat", {"top_logprobs": -2}, "top_logprobs",
     "`top_logprobs` must be a positive value or -1."),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("chat", {"logprob_token_ids": []}, "logprob_token_ids",
     "`logprob_token_ids` must not be an empty list."),
    ("chat", {"logprobs": False, "logprob_token_ids": []}, "logprob_token_ids",
     "`logprob_token_ids` must not be an empty list."),
    ("chat", {"logprobs": True, "logprob_token_ids": []}, "logprob_token_ids",
     "`logprob_token_ids` must not be an empty list."),
    ("chat", {"logprob_token_ids": [5]}, "logprob_token_ids",
     "when using `logprob_token_ids`, `logprobs` must be set to true."),
    ("chat", {"continue_final_message": True}, None,
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    ("chat", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ("chat", {"n": 3, "temperature": 0.0}, "n", "n must be 1 when using greedy sampling, got 3."),
]


def _body(server, route: str, fields: dict) -> tuple[str, dict]:
    if route == "chat":
        return "/v1/chat/completions", {"model": served_name(server), "messages": MESSAGES,
                                        "max_tokens": 3, **fields}
    return "/v1/completions", {"model": served_name(server), "prompt": "Hello",
                               "max_tokens": 3, **fields}


@pytest.mark.parametrize(("route", "fields", "param", "says"), REFUSED_AS_VLLM,
                         ids=lambda v: str(v)[:40])
def test_refused_in_vllm_words(server, route, fields, param, says):
    response = post(server, *_body(server, route, fields))
    assert response.status_code == 400, response.text
    error = strict_json(response.content)["error"]
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(("route", "fields"), [
    ("completions", {"stream_options": {}}),  # vLLM tests the dict's truth: {} asks nothing
    ("completions", {"prompt_embeds": []}),  # empty embeds beside a prompt
    ("completions", {"presence_penalty": 2.0, "frequency_penalty": -2.0, "temperature": 2.0}),
    ("chat", {"tool_choice": "none"}),
    ("chat", {"n": 2, "temperature": 0.5, "top_logprobs": 0}),
    # A positive temperature below 0.01 samples at 0.01 (vLLM's floor): not greedy, n > 1 is
    # allowed.
    ("completions", {"n": 2, "temperature": 1e-6}),
])
def test_accepted_as_vllm_accepts(server, route, fields):
    response = post(server, *_body(server, route, fields))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("content_type", "status"), [
    ("text/plain", 400), (None, 400), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200),
])
def test_only_json_bodies_are_read(server, content_type, status):
    """vLLM's validate_json_request: the media type must be application/json."""
    path, body = _body(server, "completions", {})
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(server.url + path, content=json.dumps(body), headers=headers,
                          timeout=60.0)
    assert response.status_code == status, response.text
    if status == 400:
        assert strict_json(response.content)["error"]["message"] == (
            "Unsupported Media Type: Only 'application/json' is allowed")


def test_seed_minus_one_is_unseeded(server):
    """vLLM's SamplingParams turns seed -1 into no seed: repeated requests draw anew, where
    one seed repeats itself."""
    def texts(seed: int) -> set[str]:
        return {strict_json(post(server, *_body(server, "completions", {
            "seed": seed, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True,
        })).content)["choices"][0]["text"] for _ in range(4)}

    assert len(texts(7)) == 1
    assert len(texts(-1)) > 1


def _max_model_len(server) -> int:
    return strict_json(httpx.get(server.url + "/v1/models").content)["data"][0]["max_model_len"]


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("/v1/completions", {"prompt": [5] * 3, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "LONG", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "LONG"}, "prompt"),
])
def test_context_overflow_in_vllm_words(server, route, fields, param):
    """The sentence clients parse to shrink a request (agents, LiteLLM-style proxies): "You
    passed N input tokens and requested M output tokens. However, the model's context length
    is only C tokens"; the param still names the field to change."""
    limit = _max_model_len(server)
    if fields.get("prompt") == "LONG":
        fields = {**fields, "prompt": [5] * (limit + 3)}
    response = post(server, route, {"model": served_name(server), **fields})
    assert response.status_code == 400, response.text
    error = strict_json(response.content)["error"]
    assert error["param"] == param
    message = error["message"]
    if param == "prompt":
        requested = fields.get("max_tokens", 0)
        assert f"You passed {limit + 3} input tokens and requested {requested} output tokens." \
            in message
    else:
        assert f"'{param}' is too large: {10**6}." in message
        assert "You passed " in message and f"requested {10**6} output tokens" in message
    assert f"However, the model's context length is only {limit} tokens" in message


def _same_but_last_bits(a, b) -> bool:
    """Equal structures and values, floats within 1e-5."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_but_last_bits(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_but_last_bits, a, b))
    return a == b


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_invocations_answers_as_the_route_the_body_belongs_to(server, route):
    """vLLM's test_invocations (chat and completion): POST /invocations with the body of a
    greedy request gives the keys and choices of the request's own route, and the official
    client's response model reads it; streamed, the same text. A body with neither
    `messages` nor `prompt` is a completion without a prompt: vLLM's 400."""
    if route == "chat":
        path, model = "/v1/chat/completions", openai.types.chat.ChatCompletion
        body = {"model": served_name(server), "messages": MESSAGES, "max_completion_tokens": 5,
                "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    else:
        path, model = "/v1/completions", openai.types.Completion
        body = {"model": served_name(server), "prompt": "What is the capital of France?",
                "max_tokens": 5, "temperature": 0.0, "logprobs": 2}
    direct = strict_json(post(server, path, body).content)
    response = post(server, "/invocations", body)
    assert response.status_code == 200, response.text
    invoked = strict_json(response.content)
    assert invoked.keys() == direct.keys()
    # (logprob values may move in the last bits with the batch other tests' requests share)
    assert _same_but_last_bits(invoked["choices"], direct["choices"])
    model.model_validate(invoked)
    events = [line for line in post(server, "/invocations", {**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:])["choices"] for line in events]
    pieces = [(c[0]["delta"].get("content") or "") if route == "chat" else c[0]["text"]
              for c in chunks if c]
    choice = direct["choices"][0]
    assert "".join(pieces) == (choice["message"]["content"] if route == "chat"
                               else choice["text"])
    bad = post(server, "/invocations", {"model": served_name(server), "max_tokens": 5})
    assert bad.status_code == 400
    assert strict_json(bad.content)["error"]["param"] == "prompt"
