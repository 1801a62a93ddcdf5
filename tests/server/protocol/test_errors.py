"""Every refusal before admission is HTTP 400 with vLLM's error object naming the parameter."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.helpers import post, served_name, strict_json

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
IDS_129 = list(range(129))

COMPLETION_CASES = [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "many"}, "logprobs"),
    ({"logprobs": 0, "logprob_token_ids": IDS_129}, "logprob_token_ids"),
    ({"logprobs": 0, "logprob_token_ids": [3, 4, 3]}, "logprob_token_ids"),
    ({"logprobs": 0, "logprob_token_ids": [5, 100000]}, "logprob_token_ids"),
    ({"logprobs": 0, "logprob_token_ids": [-1]}, "logprob_token_ids"),
    ({"logprobs": 0, "logprob_token_ids": []}, "logprob_token_ids"),
    ({"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    ({"n": 0}, "n"),
    ({"n": -3}, "n"),
    ({"n": 1000}, "n"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"echo": True, "logprobs": 0, "logprob_token_ids": [1]}, "echo"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"100000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0, "05": 2.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"stop": ["x" * 1000]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "tail"}, "suffix"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
    ({"min_tokens": -1}, "min_tokens"),
]

CHAT_CASES = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": IDS_129}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": [7, 7]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": [100000]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": []}, "logprob_token_ids"),
    ({"n": 0}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bad", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
     "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


def check_error(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = strict_json(response.content)["error"]
    assert body["code"] == status
    assert body["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert body["param"] == param, body
    if param is not None:
        assert param in body["message"], body
    return body


@pytest.mark.parametrize(("fields", "param"), COMPLETION_CASES, ids=lambda v: str(v)[:40])
def test_completion_refusals(server, fields, param):
    body = {"model": served_name(server), "prompt": "Hi", "max_tokens": 2, **fields}
    check_error(post(server, "/v1/completions", body), param)
    if "stream_options" not in fields:
        check_error(post(server, "/v1/completions", {**body, "stream": True}), param)


@pytest.mark.parametrize(("fields", "param"), CHAT_CASES, ids=lambda v: str(v)[:40])
def test_chat_refusals(server, fields, param):
    body = {"model": served_name(server), "max_tokens": 2, **CHAT, **fields}
    check_error(post(server, "/v1/chat/completions", body), param)


def test_malformed_bodies_and_unknown_model(server):
    for raw in ["{not json", "[1, 2]", '{"prompt": "x", "temperature": NaN}', ""]:
        check_error(post(server, "/v1/completions", raw), None)
    check_error(post(server, "/v1/completions", {"prompt": "x", "model": "nope"}), "model", 404)
    check_error(post(server, "/v1/chat/completions", {**CHAT, "model": "nope"}), "model", 404)
    check_error(post(server, "/v1/completions", {}), "prompt")
    huge = '{"prompt": "x", "temperature": 1e999}'
    check_error(post(server, "/v1/completions", huge), "temperature")
    lone = '{"prompt": "x \\ud800 y"}'
    check_error(post(server, "/v1/completions", lone), "prompt")


def test_openai_client_sees_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served_name(server), prompt="Hi", logprobs=25)
    assert info.value.status_code == 400 and info.value.body["param"] == "logprobs"


def test_server_without_logprobs(plain_server):
    server = plain_server
    card = strict_json(httpx.get(server.url + "/v1/models").content)["data"][0]
    assert card["permission"][0]["allow_logprobs"] is False
    name = card["id"]
    ok = post(server, "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and strict_json(ok.content)["choices"][0]["logprobs"] is None
    chat = post(server, "/v1/chat/completions",
                {"model": name, **CHAT, "max_tokens": 3, "top_logprobs": 0, "stream": True})
    assert chat.status_code == 200 and chat.text.endswith("data: [DONE]\n\n")
    refused = [
        ("/v1/completions", {"prompt": "Hi", "logprobs": 0}),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": [1]}),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 2, "stream": True}),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "logprob_token_ids": [1]}),
    ]
    for path, body in refused:
        check_error(post(server, path, {"model": name, **body}), "logprobs")
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=name, logprobs=True, **CHAT)
