"""Token bytes, text offsets with split characters, echo, n > 1 and batched prompts."""

from __future__ import annotations

import pytest

from tests.server.helpers import (
    encoder,
    expected_offsets,
    post,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
    vocab_bytes,
)
from tests.tokenizer_fixtures import vllm_sequence_texts, vllm_token_text

pytestmark = pytest.mark.slow

SPLIT = "é中🙂".encode()


def split_char_ids(model_dir) -> list[int]:
    """Single-byte tokens of multi-byte characters plus two ASCII tokens."""
    inverse: dict[bytes, int] = {}
    for token_id, data in sorted(vocab_bytes(model_dir).items()):
        inverse.setdefault(data, token_id)
    ids = [inverse[bytes([b])] for b in sorted(set(SPLIT))]
    return ids + [inverse[b"a"], inverse[b" "]]


def check_bytes_and_offsets(server, seeds=(1, 2, 3)) -> None:
    name, table = served_name(server), vocab_bytes(server.model_dir)
    tokenizer = encoder(server.model_dir)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    allowed = split_char_ids(server.model_dir)
    seen = ""
    for seed in seeds:
        body = {"model": name, "prompt": "Hello", "max_tokens": 24, "temperature": 2.0,
                "seed": seed, "allowed_token_ids": allowed, "logprobs": 0, "ignore_eos": True}
        ids_body = {**body, "return_tokens_as_token_ids": True}
        choice = strict_json(post(server, "/v1/completions", ids_body).content)["choices"][0]
        ids = [token_id_of(t) for t in choice["logprobs"]["tokens"]]
        pieces = [table[i] for i in ids]
        text = b"".join(pieces).decode("utf-8", errors="replace")
        assert choice["text"] == text
        assert choice["logprobs"]["text_offset"] == expected_offsets(pieces)
        seen += text
        plain = strict_json(post(server, "/v1/completions", body).content)["choices"][0]
        owns = [p.decode("utf-8", errors="replace") for p in pieces]
        assert plain["logprobs"]["tokens"] == vllm_sequence_texts(decode, owns, ids)
        assert plain["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]
        events = sse_events(post(server, "/v1/completions", {**body, "stream": True}))
        offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == choice["logprobs"]["text_offset"]
        assert "".join(e["choices"][0]["text"] for e in events) == text
        chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 24, "temperature": 2.0, "seed": seed, "allowed_token_ids": allowed,
                "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
        message = strict_json(post(server, "/v1/chat/completions", chat).content)["choices"][0]
        as_ids = strict_json(post(server, "/v1/chat/completions", {
            **chat, "return_tokens_as_token_ids": True}).content)["choices"][0]
        entries = message["logprobs"]["content"]
        data = b"".join(bytes(e["bytes"]) for e in entries)
        assert message["message"]["content"] == data.decode("utf-8", errors="replace")
        generated = [token_id_of(e["token"]) for e in as_ids["logprobs"]["content"]]
        for k, (entry, named) in enumerate(zip(entries, as_ids["logprobs"]["content"],
                                               strict=True)):
            # Each text as vLLM reports it after the tokens sampled before; bytes the token's.
            for got, token_id in [(entry, generated[k])] + [
                    (alt, token_id_of(other["token"]))
                    for alt, other in zip(entry["top_logprobs"], named["top_logprobs"],
                                          strict=True)]:
                own = table[token_id].decode("utf-8", errors="replace")
                assert got["token"] == vllm_token_text(decode, own, token_id, generated[:k])
                assert bytes(got["bytes"]) == table[token_id]
    assert any(ord(c) > 127 and c != "\ufffd" for c in seen), "no multi-byte character"
    assert "\ufffd" in seen


def test_bytes_and_offsets_with_split_characters(server):
    check_bytes_and_offsets(server)


def test_echo_without_logprobs(server):
    name = served_name(server)
    body = {"model": name, "prompt": "Hello café", "max_tokens": 4, "temperature": 0.0}
    plain = strict_json(post(server, "/v1/completions", body).content)["choices"][0]
    echoed = strict_json(post(server, "/v1/completions", {**body, "echo": True}).content)
    assert echoed["choices"][0]["text"] == "Hello café" + plain["text"]
    only = strict_json(post(server, "/v1/completions", {**body, "echo": True, "max_tokens": 0})
                       .content)
    assert only["choices"][0]["text"] == "Hello café"
    assert only["usage"]["completion_tokens"] == 0
    events = sse_events(post(server, "/v1/completions", {**body, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello café" + plain["text"]


def test_n_and_batched_prompts(server):
    client, name = server.client(), served_name(server)
    response = client.completions.create(
        model=name, prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=5, seed=40, temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == 5
    for index, (prompt, seed) in enumerate([([5, 6, 7], 40), ([5, 6, 7], 41), ([8, 9], 40),
                                            ([8, 9], 41)]):
        single = client.completions.create(model=name, prompt=prompt, max_tokens=5, seed=seed,
                                           temperature=1.0, extra_body={"ignore_eos": True})
        assert single.choices[0].text == response.choices[index].text
    assert response.usage.completion_tokens == 20
    texts = client.completions.create(model=name, prompt=["Hello", "café"], max_tokens=3,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    for choice, prompt in zip(texts.choices, ["Hello", "café"], strict=True):
        alone = client.completions.create(model=name, prompt=prompt, max_tokens=3,
                                          temperature=0.0, extra_body={"ignore_eos": True})
        assert choice.text == alone.choices[0].text
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=4, seed=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    texts, usage = ["", "", ""], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    whole = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=4, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert texts == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens == 12
