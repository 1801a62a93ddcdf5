"""return_token_ids (vLLM's): the prompt's ids and every generated id (a terminating EOS
included) alongside the text; streamed, the prompt's ids ride on a choice's first chunk and
each chunk carries its own ids. Oracles: the tokenizer, the logprob entries' ids
(return_tokens_as_token_ids), and the non-streamed response."""

from __future__ import annotations

import pytest

from tests.server.helpers import (
    chat_prompt_ids,
    encoder,
    post,
    served_name,
    sse_events,
    strict_json,
)

pytestmark = pytest.mark.slow

TEXT = "The garden was quiet"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def body(server, **fields) -> dict:
    return {"model": served_name(server), "prompt": TEXT, "max_tokens": 12,
            "temperature": 0.0, "logprobs": 0, "return_tokens_as_token_ids": True,
            "return_token_ids": True, **fields}


def entry_ids(logprobs: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


def test_completion_returns_prompt_and_generated_ids(server):
    prompt_ids = encoder(server.model_dir).encode(TEXT, add_special_tokens=True).ids
    for fields in ({}, {"ignore_eos": True}, {"n": 2, "seed": 3, "temperature": 1.0}):
        response = post(server, "/v1/completions", body(server, **fields))
        assert response.status_code == 200, response.text
        payload = strict_json(response.content)
        for choice in payload["choices"]:
            assert choice["prompt_token_ids"] == prompt_ids
            generated = entry_ids(choice["logprobs"])
            ids = choice["token_ids"]
            # A terminating EOS has no entry but is one of the generated ids.
            assert ids[: len(generated)] == generated and len(ids) - len(generated) in (0, 1)
        used = sum(len(c["token_ids"]) for c in payload["choices"])
        assert payload["usage"]["completion_tokens"] == used


def test_streamed_ids_equal_the_whole_response(server):
    whole = strict_json(post(server, "/v1/completions", body(server)).content)["choices"][0]
    events = sse_events(post(server, "/v1/completions", body(server, stream=True)))
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]


def test_truncated_prompt_ids_are_the_kept_ones(server):
    prompt_ids = encoder(server.model_dir).encode(TEXT, add_special_tokens=True).ids
    for side, kept in (("left", prompt_ids[-3:]), ("right", prompt_ids[:3])):
        response = post(server, "/v1/completions", body(
            server, truncate_prompt_tokens=3, truncation_side=side))
        assert strict_json(response.content)["choices"][0]["prompt_token_ids"] == kept


def test_chat_returns_prompt_and_generated_ids(server):
    chat = {"model": served_name(server), "messages": MESSAGES, "max_tokens": 10,
            "temperature": 0.0, "logprobs": True, "return_token_ids": True}
    whole = strict_json(post(server, "/v1/chat/completions", chat).content)
    assert whole["prompt_token_ids"] == chat_prompt_ids(server.model_dir, MESSAGES)
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"]
    assert len(whole["choices"][0]["logprobs"]["content"]) in (len(ids), len(ids) - 1)
    events = sse_events(post(server, "/v1/chat/completions", {**chat, "stream": True}))
    firsts = [e for e in events if "prompt_token_ids" in e]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    # On the role chunk, the first of the stream, as vLLM sends it.
    assert firsts[0] is events[0] and events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == ids


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 6])
def test_echo_leaves_the_prompt_text_to_the_prompt_ids(scoring_server, stream, max_tokens):
    """vLLM's serving_completion sets the echoed prompt text to "" under return_token_ids:
    the text is the generated text alone (the prompt travels as prompt_token_ids), while the
    logprobs arrays keep the prompt positions and their offsets. Oracle: the same request
    without return_token_ids, whose text is the prompt then the same generated text."""
    server = scoring_server  # (echo with logprobs scores the prompt)
    fields = {"echo": True, "max_tokens": max_tokens}
    plain = strict_json(post(server, "/v1/completions",
                             body(server, return_token_ids=False, **fields)).content)
    plain = plain["choices"][0]
    assert plain["text"].startswith(TEXT)
    request = body(server, stream=stream, **fields)
    response = post(server, "/v1/completions", request)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [e["choices"][0] for e in sse_events(response) if e["choices"]]
        text = "".join(c["text"] for c in chunks)
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    else:
        choice = strict_json(response.content)["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        offsets = choice["logprobs"]["text_offset"]
    assert text == plain["text"][len(TEXT):]
    assert tokens == plain["logprobs"]["tokens"]
    assert offsets == plain["logprobs"]["text_offset"]
