"""Stop strings, EOS, ignore_eos and stop_token_ids: entries only for contributing tokens."""

from __future__ import annotations

from functools import cache

import pytest

from tests.server.helpers import (
    TOLERANCE,
    hf_rows,
    post,
    same,
    served_name,
    sse_events,
    strict_json,
    vocab_bytes,
)
from tests.tokenizer_fixtures import byte_level_tokenizer, eos_id

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


@cache
def word_ids(model_dir) -> tuple[int, ...]:
    """Tokens of two or more ASCII letters/spaces: generated text is then plain and stable."""
    return tuple(i for i, data in vocab_bytes(model_dir).items()
                 if len(data) >= 2 and all(c == 32 or chr(c).isalpha() and c < 128
                                           for c in data))


def body(server, **extra) -> dict:
    return {"model": served_name(server), "prompt": PROMPT, "max_tokens": 16,
            "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
            "allowed_token_ids": list(word_ids(server.model_dir)), **extra}


def completion(server, **extra) -> dict:
    response = post(server, "/v1/completions", body(server, **extra))
    assert response.status_code == 200, response.text
    return strict_json(response.content)["choices"][0]


def streamed(server, **extra) -> dict:
    events = sse_events(post(server, "/v1/completions", body(server, stream=True, **extra)))
    out = {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []}
    for event in events:
        choice = event["choices"][0]
        out["text"] += choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            out[key] += choice["logprobs"][key]
        out["finish_reason"], out["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
    return out


@pytest.fixture(scope="module")
def baseline(server) -> dict:
    choice = completion(server)
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 16
    return choice


def stop_cases(base: dict) -> dict[str, tuple[str, int]]:
    """name -> (stop string, character where its first occurrence starts)."""
    text, tokens = base["text"], base["logprobs"]["tokens"]
    offsets = base["logprobs"]["text_offset"]
    cases = {"first": (tokens[0][:2], 0)}
    for j in range(1, len(tokens) - 2):
        inside = tokens[j][1:3]
        if len(tokens[j]) >= 3 and text.find(inside) == offsets[j] + 1:
            cases.setdefault("inside", (inside, offsets[j] + 1))
        across = tokens[j][-1] + tokens[j + 1] + tokens[j + 2][:1]
        start = offsets[j] + len(tokens[j]) - 1
        if text.find(across) == start:
            cases.setdefault("across", (across, start))
    assert set(cases) == {"first", "inside", "across"}, (text, tokens)
    return cases


@pytest.mark.parametrize("case", ["first", "inside", "across"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_keep_entries_of_contributing_tokens(server, baseline, case, include):
    stop, start = stop_cases(baseline)[case]
    cut = start + len(stop) if include else start
    lp = baseline["logprobs"]
    keep = sum(1 for offset in lp["text_offset"] if offset < cut)
    extra = {"stop": [stop, "never matches"], "include_stop_str_in_output": include}
    choice = completion(server, **extra)
    assert choice["text"] == baseline["text"][:cut]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    got = choice["logprobs"]
    assert got["tokens"] == lp["tokens"][:keep]
    assert same(got["token_logprobs"], lp["token_logprobs"][:keep])
    assert got["text_offset"] == lp["text_offset"][:keep]
    assert same(got["top_logprobs"], lp["top_logprobs"][:keep])
    stream = streamed(server, **extra)
    assert stream["text"] == choice["text"]
    assert stream["tokens"] == got["tokens"] and stream["text_offset"] == got["text_offset"]
    assert (stream["finish_reason"], stream["stop_reason"]) == ("stop", stop)
    if case == "first" and not include:
        assert choice["text"] == "" and got["tokens"] == []


def test_chat_stop_string_across_tokens(server, baseline):
    client = server.client()
    request = dict(model=served_name(server), messages=[{"role": "user", "content": PROMPT}],
                   max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=1,
                   extra_body={"allowed_token_ids": list(word_ids(server.model_dir)),
                               "ignore_eos": True})
    full = client.chat.completions.create(**request).choices[0]
    entries = full.logprobs.content
    stop = entries[2].token[-1] + entries[3].token[:1]
    text = full.message.content
    start = text.find(stop)
    offsets = [len("".join(e.token for e in entries[:k])) for k in range(len(entries))]
    keep = sum(1 for offset in offsets if offset < start)
    stopped = client.chat.completions.create(**request, stop=stop).choices[0]
    assert stopped.message.content == text[:start]
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", stop)
    kept = stopped.logprobs.content
    assert same([(e.token, e.logprob) for e in kept],
                [(e.token, e.logprob) for e in entries[:keep]])


def eos(_server) -> int:
    return eos_id(byte_level_tokenizer())


def test_forced_eos_has_no_entry(server):
    choice = completion(server, ignore_eos=False, allowed_token_ids=None,
                        logit_bias={str(eos(server)): 100})
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == []
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    whole = strict_json(post(server, "/v1/completions", body(
        server, ignore_eos=False, allowed_token_ids=None, logit_bias={str(eos(server)): 100},
        stop_token_ids=[eos(server)])).content)
    assert whole["usage"]["completion_tokens"] == 1
    assert whole["choices"][0]["stop_reason"] is None
    stream = streamed(server, ignore_eos=False, allowed_token_ids=None,
                      logit_bias={str(eos(server)): 100})
    assert stream["tokens"] == [] and stream["finish_reason"] == "stop"
    chat = server.client().chat.completions.create(
        model=served_name(server), messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        logprobs=True, logit_bias={str(eos(server)): 100},
    ).choices[0]
    assert chat.message.content == "" and chat.logprobs.content == []
    assert chat.finish_reason == "stop"


def test_ignored_eos_keeps_entries_in_order(server):
    token = eos(server)
    choice = completion(server, allowed_token_ids=None, logit_bias={str(token): 100},
                        max_tokens=3, return_tokens_as_token_ids=True)
    lp = choice["logprobs"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert lp["tokens"] == [f"token_id:{token}"] * 3 and lp["text_offset"] == [0, 0, 0]
    prompt_ids = byte_level_tokenizer().encode(PROMPT).ids
    rows = hf_rows(server.model_dir, prompt_ids, [token] * 3)
    for j in range(3):
        assert abs(lp["token_logprobs"][j] - float(rows[j, token])) <= TOLERANCE
    plain = completion(server, allowed_token_ids=None, logit_bias={str(token): 100}, max_tokens=3)
    assert plain["logprobs"]["tokens"] == ["<|endoftext|>"] * 3


def test_stop_token_ids_report_the_id_without_entry(server):
    word = word_ids(server.model_dir)[0]
    choice = completion(server, allowed_token_ids=[word], stop_token_ids=[word])
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == []
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", word)
