"""Logprob values over HTTP equal transformers' FP32 log_softmax; streamed equals non-streamed."""

from __future__ import annotations

import httpx
import pytest

from tests.oracles import check_natural
from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    encoder,
    hf_rows,
    natural_from_dict,
    post,
    same,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
)

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world, the café is", "中文 and 日本語 mixed", "emoji 🙂 party 🎉 and"]
IDS = {"return_tokens_as_token_ids": True}


def check_completion(server, prompt_ids: list[int], n: int, **extra) -> None:
    body = {"model": served_name(server), "prompt": prompt_ids, "max_tokens": 8, "logprobs": n,
            **IDS, **extra}
    raw = post(server, "/v1/completions", body)
    assert raw.status_code == 200, raw.text
    choice = strict_json(raw.content)["choices"][0]
    lp = choice["logprobs"]
    generated = [token_id_of(t) for t in lp["tokens"]]
    assert len(generated) == 8
    rows = hf_rows(server.model_dir, prompt_ids, generated)
    for j, token_id in enumerate(generated):
        assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
        check_natural(natural_from_dict(lp["top_logprobs"][j], token_id, n), rows[j], n)


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_completion_logprobs_match_transformers(server, n):
    tok = encoder(server.model_dir)
    for text in PROMPTS[:2]:
        ids = tok.encode(text).ids
        check_completion(server, ids, n, temperature=0.0, ignore_eos=True)
    # Sampling transformations do not change the reported values (raw FP32 normalization).
    check_completion(server, tok.encode(PROMPTS[2]).ids, n, temperature=0.8, top_k=7,
                     top_p=0.9, seed=11, ignore_eos=True, repetition_penalty=1.3)


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_chat_logprobs_match_transformers(server, n):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": PROMPTS[n % 3]}]
    prompt_ids = chat_prompt_ids(server.model_dir, messages)
    response = client.chat.completions.create(
        model=served_name(server), messages=messages, max_tokens=8, logprobs=True,
        top_logprobs=n, seed=n, temperature=1.0, extra_body={**IDS, "ignore_eos": True},
    )
    assert response.usage.prompt_tokens == len(prompt_ids)
    content = response.choices[0].logprobs.content
    generated = [token_id_of(item.token) for item in content]
    assert len(generated) == response.usage.completion_tokens == 8
    rows = hf_rows(server.model_dir, prompt_ids, generated)
    for j, item in enumerate(content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
        natural = [(token_id_of(alt.token), alt.logprob) for alt in item.top_logprobs]
        check_natural(natural, rows[j], n)


def test_logprob_token_ids_report_caller_order(server):
    tok = encoder(server.model_dir)
    prompt_ids = tok.encode(PROMPTS[0]).ids
    head = [200, 3, 17, 0, 150, 5]
    selected = head + [i for i in range(30, 160) if i not in head][:122]
    assert len(selected) == 128
    name = served_name(server)
    raw = post(server, "/v1/completions", {
        "model": name, "prompt": prompt_ids, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
        "logprob_token_ids": selected, "ignore_eos": True, **IDS,
    })
    assert raw.status_code == 200, raw.text
    lp = strict_json(raw.content)["choices"][0]["logprobs"]
    generated = [token_id_of(t) for t in lp["tokens"]]
    assert len(generated) == len(lp["top_logprobs"]) == len(lp["token_logprobs"]) == 4
    rows = hf_rows(server.model_dir, prompt_ids, generated)
    for j, top in enumerate(lp["top_logprobs"]):
        assert [token_id_of(k) for k in top] == selected
        for token_id, value in top.items():
            assert abs(value - float(rows[j, token_id_of(token_id)])) <= TOLERANCE
        assert abs(lp["token_logprobs"][j] - float(rows[j, generated[j]])) <= TOLERANCE
    messages = [{"role": "user", "content": PROMPTS[1]}]
    response = server.client().chat.completions.create(
        model=name, messages=messages, max_tokens=3, temperature=0.0, logprobs=True,
        extra_body={"logprob_token_ids": selected[:6], "ignore_eos": True, **IDS},
    )
    chat_ids = chat_prompt_ids(server.model_dir, messages)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 3
    generated = [token_id_of(c.token) for c in content]
    rows = hf_rows(server.model_dir, chat_ids, generated)
    for j, item in enumerate(content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
        assert [token_id_of(a.token) for a in item.top_logprobs] == selected[:6]
        for alt in item.top_logprobs:
            assert abs(alt.logprob - float(rows[j, token_id_of(alt.token)])) <= TOLERANCE


def _merge_completion_stream(events: list) -> tuple[str, dict, dict]:
    text, merged, usage = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}, {}
    finish = None
    for event in events:
        if not event["choices"]:
            usage = event["usage"]
            continue
        choice = event["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += (choice["logprobs"] or {}).get(key, [])
        finish = choice["finish_reason"] or finish
    return text, merged, {"usage": usage, "finish_reason": finish}


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_streamed_entries_equal_non_streamed(server, sampling):
    name = served_name(server)
    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 12, "logprobs": 5, **sampling}
    whole = strict_json(post(server, "/v1/completions", body).content)
    events = sse_events(post(server, "/v1/completions", {
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    text, merged, rest = _merge_completion_stream(events)
    choice = whole["choices"][0]
    assert text == choice["text"]
    assert same(merged, choice["logprobs"])
    assert rest["usage"] == whole["usage"] and rest["finish_reason"] == choice["finish_reason"]
    for event in events[:-1]:
        lp = event["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])

    chat = {"model": name, "messages": [{"role": "user", "content": PROMPTS[2]}],
            "max_tokens": 12, "logprobs": True, "top_logprobs": 3, **sampling}
    whole = strict_json(post(server, "/v1/chat/completions", chat).content)
    events = sse_events(post(server, "/v1/chat/completions", {**chat, "stream": True}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content, entries = "", []
    for event in events:
        choice = event["choices"][0]
        content += choice["delta"].get("content", "")
        entries += (choice["logprobs"] or {"content": []})["content"]
    assert content == whole["choices"][0]["message"]["content"]
    assert same(entries, whole["choices"][0]["logprobs"]["content"])


def test_usage_and_model_card(server):
    # No max_tokens: the completions default is 16 (ignore_eos, so exactly 16 come back).
    body = {"prompt": "x", "ignore_eos": True, "logprobs": 0, **IDS}
    card = strict_json(post(server, "/v1/completions", body).content)
    choice, usage = card["choices"][0], card["usage"]
    assert len(choice["logprobs"]["tokens"]) == usage["completion_tokens"] == 16
    assert choice["finish_reason"] == "length"
    assert usage["prompt_tokens"] == len(encoder(server.model_dir).encode("x").ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16
    models = server.client().models.list().data
    assert len(models) == 1
    raw = strict_json(httpx.get(server.url + "/v1/models").content)
    permission = raw["data"][0]["permission"][0]
    assert permission["allow_logprobs"] is True and raw["data"][0]["max_model_len"] == 256
