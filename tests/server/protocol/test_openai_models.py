"""Responses of every generation route, validated strictly by the openai package's own pydantic
models (the client builds them without validation, so a missing required field or a wrong type
would otherwise pass unnoticed)."""

from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.server.helpers import post, served_name, sse_events, strict_json

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fields", [
    {"logprobs": 3},
    {"echo": True, "n": 2, "temperature": 1.0, "seed": 3},
    {"stop": ["e"], "logprobs": 1},
])
def test_completions_validate(server, fields):
    body = {"model": served_name(server), "prompt": "The garden", "max_tokens": 5, **fields}
    Completion.model_validate(strict_json(post(server, "/v1/completions", body).content))
    chunks = sse_events(post(server, "/v1/completions",
                             {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks
    for chunk in chunks:
        # The package's CompletionChoice has no null finish_reason, though streams (OpenAI's
        # and vLLM's) send null until a choice ends: only that field is filled in here.
        choices = [{**c, "finish_reason": c["finish_reason"] or "length"}
                   for c in chunk["choices"]]
        Completion.model_validate({**chunk, "choices": choices})


@pytest.mark.parametrize("fields", [
    {"logprobs": True, "top_logprobs": 3},
    {"n": 2, "temperature": 1.0, "seed": 5, "logprobs": True},
    {},
])
def test_chat_validates(server, fields):
    body = {"model": served_name(server), "max_tokens": 5,
            "messages": [{"role": "user", "content": "Name a colour."}], **fields}
    ChatCompletion.model_validate(strict_json(post(server, "/v1/chat/completions", body).content))
    chunks = sse_events(post(server, "/v1/chat/completions",
                             {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
