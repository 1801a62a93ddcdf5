"""Stream shape as vLLM sends it: the finish rides on the chunk that carries the last token.

One chunk per generated token (plus chat's role chunk and the usage chunk); exactly one chunk
per choice has a finish_reason, it is that choice's last chunk, and it carries text unless no
text is left at all (a stream whose first token ends it). Joined chunks equal the
non-streamed response. A real server (the `server` fixture) and an in-process app over a
scripted engine (for EOS placements the model cannot be made to produce).
"""

from __future__ import annotations

import asyncio
from functools import cache

import httpx
import pytest

from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import EngineError, Finished, GeneratedToken, TokenLogprob
from tests.server.helpers import (
    encoder,
    post,
    same,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
    vocab_bytes,
)
from tests.server.scripted_engine import ScriptedEngine

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": PROMPT}]
TOKENS = 6


@cache
def word_ids(model_dir) -> tuple[int, ...]:
    """Tokens of two or more ASCII letters/spaces: each one's text is released at once."""
    return tuple(i for i, data in vocab_bytes(model_dir).items()
                 if len(data) >= 2 and all(c == 32 or chr(c).isascii() and chr(c).isalpha()
                                           for c in data))


def sampling(server, **extra) -> dict:
    return {"model": served_name(server), "max_tokens": TOKENS, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "allowed_token_ids": list(word_ids(server.model_dir)), **extra}


def split(events: list, text_of) -> tuple[dict[int, list[dict]], dict | None]:
    """Choice chunks by index, and the usage chunk (which must come last, choices empty)."""
    usage = None
    per_choice: dict[int, list[dict]] = {}
    for at, event in enumerate(events):
        if not event["choices"]:
            assert at == len(events) - 1 and "usage" in event, event
            usage = event["usage"]
            continue
        assert len(event["choices"]) == 1
        choice = event["choices"][0]
        per_choice.setdefault(choice["index"], []).append(choice)
    for chunks in per_choice.values():
        finishing = [c for c in chunks if c["finish_reason"] is not None]
        assert len(finishing) == 1 and finishing[0] is chunks[-1], chunks
        assert all(text_of(c) or c["logprobs"] or "role" in c.get("delta", {})
                   for c in chunks[:-1]), chunks
    return per_choice, usage


def completion_text(choice: dict) -> str:
    return choice["text"]


def chat_text(choice: dict) -> str:
    return choice["delta"].get("content") or ""


def joined_completion(chunks: list[dict]) -> dict:
    out = {"text": "".join(c["text"] for c in chunks), "logprobs": None}
    if chunks[0]["logprobs"] is not None:
        out["logprobs"] = {k: [v for c in chunks for v in c["logprobs"][k]]
                           for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    out["finish_reason"], out["stop_reason"] = chunks[-1]["finish_reason"], chunks[-1][
        "stop_reason"]
    return out


# ----------------------------------------------------------------------------- real server
@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_completion_one_chunk_per_token(server, n, logprobs):
    body = {**sampling(server, n=n, logprobs=logprobs), "prompt": PROMPT}
    whole = strict_json(post(server, "/v1/completions", body).content)
    events = sse_events(post(server, "/v1/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    per_choice, usage = split(events, completion_text)
    assert usage == whole["usage"] and usage["completion_tokens"] == n * TOKENS
    assert sorted(per_choice) == list(range(n))
    for choice in whole["choices"]:
        chunks = per_choice[choice["index"]]
        assert len(chunks) == TOKENS, [c["text"] for c in chunks]
        assert all(c["text"] for c in chunks)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["stop_reason"] is None
        if logprobs is not None:
            assert all(len(c["logprobs"]["tokens"]) == 1 for c in chunks)
        got = joined_completion(chunks)
        assert got["text"] == choice["text"]
        assert same(got["logprobs"], choice["logprobs"])


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_one_chunk_per_token(server, n, logprobs):
    client = server.client()
    body = sampling(server, n=n)
    request = dict(model=body.pop("model"), messages=MESSAGES, n=n, logprobs=logprobs,
                   max_tokens=body.pop("max_tokens"), temperature=body.pop("temperature"),
                   seed=body.pop("seed"), extra_body=body)
    if logprobs:
        request["top_logprobs"] = 2
    whole = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True,
                                            stream_options={"include_usage": True})
    events = [chunk.model_dump(exclude_unset=True) for chunk in stream]
    per_choice, usage = split(events, chat_text)
    assert usage["completion_tokens"] == whole.usage.completion_tokens == n * TOKENS
    for choice in whole.choices:
        chunks = per_choice[choice.index]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        tokens = chunks[1:]
        assert len(tokens) == TOKENS, [chat_text(c) for c in tokens]
        assert all(chat_text(c) for c in tokens)
        assert tokens[-1]["finish_reason"] == "length"
        assert "".join(chat_text(c) for c in tokens) == choice.message.content
        if logprobs:
            entries = [e for c in tokens for e in c["logprobs"]["content"]]
            assert all(len(c["logprobs"]["content"]) == 1 for c in tokens)
            expected = [e.model_dump() for e in choice.logprobs.content]
            assert same(entries, expected)


@pytest.fixture(scope="module")
def baseline(server) -> dict:
    """A 12-token greedy-free seeded completion with its token ids."""
    body = {**sampling(server, max_tokens=12, logprobs=0, return_tokens_as_token_ids=True),
            "prompt": PROMPT}
    choice = strict_json(post(server, "/v1/completions", body).content)["choices"][0]
    ids = [token_id_of(t) for t in choice["logprobs"]["tokens"]]
    assert len(ids) == 12
    return {"text": choice["text"], "ids": ids}


def _first_new(ids: list[int], start: int) -> int:
    return next(j for j in range(start, len(ids)) if ids[j] not in ids[:j])


@pytest.mark.slow
def test_stop_token_id_finish_rides_on_the_last_text_chunk(server, baseline):
    ids = baseline["ids"]
    j = _first_new(ids, 3)
    body = {**sampling(server, max_tokens=12, logprobs=1, stop_token_ids=[ids[j]]),
            "prompt": PROMPT}
    whole = strict_json(post(server, "/v1/completions", body).content)
    choice = whole["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[j])
    assert whole["usage"]["completion_tokens"] == j + 1
    events = sse_events(post(server, "/v1/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    per_choice, usage = split(events, completion_text)
    chunks = per_choice[0]
    assert len(chunks) == j and all(c["text"] for c in chunks)
    assert usage == whole["usage"]
    got = joined_completion(chunks)
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", ids[j])
    assert got["text"] == choice["text"] and same(got["logprobs"], choice["logprobs"])

    client = server.client()
    extra = {"allowed_token_ids": list(word_ids(server.model_dir)), "ignore_eos": True,
             "stop_token_ids": [ids[j]]}
    chat = dict(model=served_name(server), messages=MESSAGES, max_tokens=12, seed=11,
                temperature=1.0, extra_body=extra)
    whole_chat = client.chat.completions.create(**chat).choices[0]
    events = [c.model_dump(exclude_unset=True)
              for c in client.chat.completions.create(**chat, stream=True)]
    chat_chunks = split(events, chat_text)[0][0][1:]
    assert chat_chunks and all(chat_text(c) for c in chat_chunks)
    assert chat_chunks[-1]["finish_reason"] == whole_chat.finish_reason == "stop"
    assert "".join(chat_text(c) for c in chat_chunks) == whole_chat.message.content


@pytest.mark.slow
def test_first_token_stop_sends_one_empty_finish_chunk(server, baseline):
    first = baseline["ids"][0]
    body = {**sampling(server, logprobs=1, stop_token_ids=[first]), "prompt": PROMPT,
            "stream": True}
    chunks = split(sse_events(post(server, "/v1/completions", body)), completion_text)[0][0]
    assert len(chunks) == 1
    assert chunks[0]["text"] == "" and chunks[0]["logprobs"]["tokens"] == []
    assert (chunks[0]["finish_reason"], chunks[0]["stop_reason"]) == ("stop", first)


@pytest.mark.slow
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_releases_held_text_with_the_finish(server, baseline, include):
    text = baseline["text"]
    middle = len(text) // 2
    stop = next(text[k:k + 3] for k in range(middle, len(text) - 3)
                if text.find(text[k:k + 3]) == k and text[k] != " ")
    body = {**sampling(server, max_tokens=12, logprobs=1, stop=[stop],
                       include_stop_str_in_output=include), "prompt": PROMPT}
    choice = strict_json(post(server, "/v1/completions", body).content)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    events = sse_events(post(server, "/v1/completions", {**body, "stream": True}))
    chunks = split(events, completion_text)[0][0]
    assert chunks[-1]["text"]
    got = joined_completion(chunks)
    assert got["text"] == choice["text"] and same(got["logprobs"], choice["logprobs"])
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop)


# ----------------------------------------------------------------------------- in-process
def call(engine, model_dir, path: str, body: dict) -> httpx.Response:
    app = create_app(engine, model_dir, "scripted")

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def stream_events(response: httpx.Response) -> list:
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    return [strict_json(b[len("data: "):]) for b in blocks[:-1]]


@cache
def scripted_ids(model_dir) -> tuple[list[int], int]:
    """Three word tokens and the id of a lone UTF-8 lead byte (0xC3)."""
    words = list(word_ids(model_dir)[:3])
    lead = encoder(model_dir).token_to_id("Ã")
    assert lead is not None
    return words, lead


@cache
def letters_then_lead(model_dir) -> int:
    """A token of ASCII letters ending in a two-byte lead byte (e.g. b"i\\xc3")."""
    return next(i for i, data in vocab_bytes(model_dir).items()
                if len(data) >= 2 and data[:-1].isascii() and data[:-1].isalpha()
                and 0xC2 <= data[-1] <= 0xDF)


def scripted(tokens: list[int], end: Finished) -> list:
    return [GeneratedToken(i, t, -0.5 - i, (TokenLogprob(t, -0.5 - i),))
            for i, t in enumerate(tokens)] + [end]


ENDINGS = {"eos": Finished("stop", 0), "stop_token": Finished("stop", 5),
           "length": Finished("length")}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("n", [1, 2])
def test_scripted_finish_rides_on_the_last_token(model_dirs, ending, n):
    model_dir = model_dirs["byte_level"]
    words, _ = scripted_ids(model_dir)
    engine = ScriptedEngine(scripted(words, ENDINGS[ending]))
    extra = {"stop_token_ids": [5]} if ending == "stop_token" else {}
    body = {"prompt": [5, 6], "max_tokens": 3, "logprobs": 1, "n": n, **extra}
    whole = strict_json(call(engine, model_dir, "/v1/completions", body).content)
    response = call(engine, model_dir, "/v1/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}})
    events = stream_events(response)
    per_choice, usage = split(events, completion_text)
    assert usage == whole["usage"]
    for choice in whole["choices"]:
        chunks = per_choice[choice["index"]]
        assert len(chunks) == len(words) and all(c["text"] for c in chunks)
        got = joined_completion(chunks)
        assert got == {k: choice[k] for k in got}
    # continuous usage: the last chunk counts the terminating token too
    last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert last["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] // n

    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": n,
            "logprobs": True, **extra}
    whole = strict_json(call(engine, model_dir, "/v1/chat/completions", chat).content)
    events = stream_events(call(engine, model_dir, "/v1/chat/completions",
                                {**chat, "stream": True}))
    per_choice, _ = split(events, chat_text)
    for choice in whole["choices"]:
        chunks = per_choice[choice["index"]]
        assert len(chunks) == 1 + len(words) and all(chat_text(c) for c in chunks[1:])
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
        assert chunks[-1]["stop_reason"] == choice["stop_reason"]
        assert "".join(chat_text(c) for c in chunks) == choice["message"]["content"]
        entries = [e for c in chunks[1:] for e in c["logprobs"]["content"]]
        assert entries == choice["logprobs"]["content"]


def test_scripted_held_partial_character_is_released_with_the_finish(model_dirs):
    model_dir = model_dirs["byte_level"]
    words, lead = scripted_ids(model_dir)
    engine = ScriptedEngine(scripted([words[0], lead], Finished("stop", 0)))
    body = {"prompt": [5, 6], "max_tokens": 3, "logprobs": 1}
    whole = strict_json(call(engine, model_dir, "/v1/completions", body).content)["choices"][0]
    assert whole["text"].endswith("\ufffd") and len(whole["logprobs"]["tokens"]) == 2
    chunks = split(stream_events(call(engine, model_dir, "/v1/completions",
                                      {**body, "stream": True})), completion_text)[0][0]
    assert [c["text"] for c in chunks] == [whole["text"][:-1], "\ufffd"]
    assert [c["finish_reason"] for c in chunks] == [None, "stop"]
    assert joined_completion(chunks) == {k: whole[k] for k in joined_completion(chunks)}


def test_scripted_flushed_tail_joins_its_own_token(model_dirs):
    """A partial character flushed at the end belongs to the last token's chunk."""
    model_dir = model_dirs["byte_level"]
    words, _ = scripted_ids(model_dir)
    mixed = letters_then_lead(model_dir)
    engine = ScriptedEngine(scripted([words[0], mixed], Finished("length")))
    body = {"prompt": [5, 6], "max_tokens": 2, "logprobs": 0}
    whole = strict_json(call(engine, model_dir, "/v1/completions", body).content)["choices"][0]
    assert whole["text"].endswith("\ufffd")
    chunks = split(stream_events(call(engine, model_dir, "/v1/completions",
                                      {**body, "stream": True})), completion_text)[0][0]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 1]
    assert chunks[-1]["text"].endswith("\ufffd") and len(chunks[-1]["text"]) >= 2
    assert joined_completion(chunks) == {k: whole[k] for k in joined_completion(chunks)}


def test_scripted_first_event_finishes(model_dirs):
    model_dir = model_dirs["byte_level"]
    engine = ScriptedEngine([Finished("stop", 0)])
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    chunks = split(stream_events(call(engine, model_dir, "/v1/chat/completions", chat)),
                   chat_text)[0][0]
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""},
                                            {"content": ""}]
    assert chunks[-1]["finish_reason"] == "stop"


def test_scripted_failure_still_sends_the_held_token(model_dirs):
    model_dir = model_dirs["byte_level"]
    words, _ = scripted_ids(model_dir)
    script = scripted(words[:2], Finished("length"))[:2] + [EngineError("peer rank 1 lost")]
    engine = ScriptedEngine(script)
    events = stream_events(call(engine, model_dir, "/v1/completions",
                                {"prompt": [5, 6], "max_tokens": 3, "logprobs": 1,
                                 "stream": True}))
    assert [e["choices"][0]["logprobs"]["token_logprobs"] for e in events[:-1]] == [[-0.5],
                                                                                    [-1.5]]
    assert "peer rank 1 lost" in events[-1]["error"]["message"]
