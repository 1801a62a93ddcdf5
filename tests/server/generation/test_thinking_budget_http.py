"""thinking_token_budget through the server, on a scripted checkpoint whose output a prompt
scripts (tests/scripted_checkpoint.py): the forced end string is in the text and has no
logprob entry in either format, offsets stay right, streaming equals non-streaming."""

from __future__ import annotations

import json

import pytest

from tests.scripted_checkpoint import (
    END_THINK,
    SEP,
    default_successors,
    encode,
    write_scripted,
)
from tests.server.helpers import launch, post, response_events, sse_events, strict_json

pytestmark = pytest.mark.slow

CHAT_TEMPLATE = ("{% if reasoning_effort is defined %}{{ reasoning_effort }}{% endif %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")
"""The messages' contents, after the reasoning effort when the request gives one."""


def serve_scripted(tmp_path_factory, name: str, successors: dict[str, str] | None = None,
                   parser: str | None = "qwen3"):
    """A server on the scripted checkpoint with CHAT_TEMPLATE (a generator: yields it, stops
    it)."""
    root = tmp_path_factory.mktemp(name)
    model_dir = write_scripted(root / "model", {**default_successors(), **(successors or {})})
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    flags = ["--reasoning-parser", parser] if parser else []
    server = launch(name, model_dir, 1, ["--capacity", "2", *flags], root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    yield from serve_scripted(tmp_path_factory, "thinking")


def body(server, **extra) -> dict:
    return {"model": server.model_dir.name, "prompt": "<think>", "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 1,
            "thinking_token_budget": 3, **extra}


def test_completion_budget_forces_the_end_without_an_entry(thinking_server):
    server = thinking_server
    whole = strict_json(post(server, "/v1/completions", body(server)).content)["choices"][0]
    text, lp = whole["text"], whole["logprobs"]
    # <think> a b c (budget spent) </think> (forced) then the script continues: \n 0 1 2.
    assert text == "abc" + END_THINK + "\n012"
    assert whole["finish_reason"] == "length"
    # 8 generated tokens, one forced: 7 entries, none for </think>.
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 7
    assert END_THINK not in lp["tokens"]
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"])
    # Offsets point at each entry's token in the text, skipping the forced span.
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token.replace("Ċ", "\n")
    events = sse_events(post(server, "/v1/completions", body(server, stream=True)))
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    merged = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == text and merged == lp["tokens"] and offsets == lp["text_offset"]


def test_chat_budget_entries_skip_the_forced_token(thinking_server):
    server = thinking_server
    response = server.client().chat.completions.create(
        model=server.model_dir.name, messages=[{"role": "user", "content": "<think>"}],
        max_tokens=8, temperature=0.0, logprobs=True,
        extra_body={"ignore_eos": True, "thinking_token_budget": 3},
    )
    # vLLM's qwen3 split: the thinking before the end string is `reasoning`, the rest content;
    # the entries cover both (the forced end string has none).
    message = response.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("abc", "\n012")
    content = response.choices[0].logprobs.content
    assert len(content) == 7 and all(c.token != END_THINK for c in content)
    forced_id = encode(server.model_dir, END_THINK)
    assert len(forced_id) == 1


def chat_body(server, **extra) -> dict:
    return {"model": server.model_dir.name, "messages": [{"role": "user", "content": "<think>"}],
            "temperature": 0.0, "ignore_eos": True, "logprobs": True, **extra}


@pytest.mark.parametrize("max_tokens", [8, 2])
def test_streamed_reasoning_and_content_join_to_the_message(thinking_server, max_tokens):
    """Deltas carry `reasoning` until the end string and `content` after it (the end string in
    neither); joined, they equal the whole message, with every entry kept. Without an end
    string all output is reasoning and content is null."""
    server = thinking_server
    fields = dict(max_tokens=max_tokens, thinking_token_budget=3)
    whole = strict_json(post(server, "/v1/chat/completions",
                             chat_body(server, **fields)).content)["choices"][0]
    events = sse_events(post(server, "/v1/chat/completions",
                             chat_body(server, stream=True, **fields)))
    deltas = [e["choices"][0] for e in events if e["choices"]]
    reasoning = "".join(d["delta"].get("reasoning", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    entries = [c for d in deltas if d["logprobs"] for c in d["logprobs"]["content"]]
    assert reasoning == whole["message"]["reasoning"]
    assert (content or None) == whole["message"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in whole["logprobs"]["content"]]
    if max_tokens == 2:
        assert (whole["message"]["reasoning"], whole["message"]["content"]) == ("ab", None)
    hidden = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, include_reasoning=False, **fields)).content)["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] == whole["message"]["content"]


def test_budget_without_a_reasoning_configuration_is_refused(server):
    refused = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2,
                                               "thinking_token_budget": 2})
    assert refused.status_code == 400
    assert strict_json(refused.content)["error"]["param"] == "thinking_token_budget"


@pytest.fixture(scope="module")
def ending_server(tmp_path_factory):
    """The scripted model with "c" -> "</think>": it ends its thinking itself ("abc</think>"
    then "\n0123...")."""
    yield from serve_scripted(tmp_path_factory, "ending", {"c": END_THINK})


def test_responses_entries_are_the_contents_only(ending_server):
    """The contract: reasoning and delimiters get no output-text entries. Chat reports every
    token (the sampled </think> too); the Responses API's output text is the content, and its
    entries are the content tokens', streamed or not."""
    server = ending_server
    chat = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, max_tokens=8)).content)["choices"][0]
    tokens = [e["token"] for e in chat["logprobs"]["content"]]
    assert (chat["message"]["reasoning"], chat["message"]["content"]) == ("abc", "\n012")
    assert tokens == ["a", "b", "c", END_THINK, "\n", "0", "1", "2"]
    body = {"model": server.model_dir.name, "input": "<think>", "max_output_tokens": 8,
            "temperature": 0.0, "include": ["message.output_text.logprobs"]}
    whole = strict_json(post(server, "/v1/responses", body).content)
    reasoning, message = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "abc"}]
    part = message["content"][0]
    assert part["text"] == chat["message"]["content"]
    assert [e["token"] for e in part["logprobs"]] == tokens[tokens.index(END_THINK) + 1:]
    events = response_events(post(server, "/v1/responses", {**body, "stream": True}))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == part["text"]
    assert [e["token"] for d in deltas for e in d["logprobs"]] == [
        e["token"] for e in part["logprobs"]]


def responses_stream_and_whole(server, **fields) -> tuple[list, dict]:
    body = {"model": server.model_dir.name, "input": "<think>", "temperature": 0.0, **fields}
    whole = strict_json(post(server, "/v1/responses", body).content)
    events = response_events(post(server, "/v1/responses", {**body, "stream": True}))
    return events, whole


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_responses_reasoning_item_then_message(ending_server):
    """vLLM's Responses output with a reasoning parser: a reasoning item holding the reasoning
    text, then the message; streamed as OpenAI's reasoning_text events on output 0, the
    message's on output 1, and the completed response equals the non-streamed one. The openai
    client's own models accept every event and the response."""
    events, whole = responses_stream_and_whole(ending_server, max_output_tokens=8)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "abc"}]
    assert whole["output"][1]["content"][0]["text"] == "\n012"
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning"
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    reasoning = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    content = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in reasoning) == "abc"
    assert {e["output_index"] for e in reasoning} == {0}
    assert "".join(e["delta"] for e in content) == "\n012"
    assert {e["output_index"] for e in content} == {1}
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert without_ids(done) == without_ids(final["output"]) == without_ids(whole["output"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    openai_types = pytest.importorskip("openai.types.responses")
    from pydantic import TypeAdapter
    adapter = TypeAdapter(openai_types.ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    assert openai_types.Response.model_validate(whole).output_text == "\n012"


def test_responses_reasoning_without_an_end_is_the_only_item(thinking_server):
    """No end string within max_output_tokens: all output is reasoning, so the output is the
    reasoning item alone (incomplete), as vLLM leaves out an empty message."""
    events, whole = responses_stream_and_whole(thinking_server, max_output_tokens=2)
    assert whole["status"] == "incomplete"
    assert whole["output"] == [{"type": "reasoning", "id": whole["output"][0]["id"],
                                "status": "incomplete", "summary": [],
                                "content": [{"type": "reasoning_text", "text": "ab"}]}]
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])
    assert not [e for e in events if e["type"].startswith("response.output_text")]


@pytest.fixture(scope="module", params=["qwen3", None])
def silent_server(tmp_path_factory, request):
    """The scripted model ending its thinking ("abc</think>\n") and then emitting <sep>, a
    special token that skip_special_tokens leaves out of the text, before "012...";
    with and without a reasoning parser."""
    for server in serve_scripted(tmp_path_factory, "silent",
                                 {"c": END_THINK, "Ċ": SEP, SEP: "0"}, request.param):
        yield server, request.param


def test_responses_give_no_entry_to_a_token_without_text(silent_server):
    """The contract: Responses selects a token only when its first text byte is content, so a
    skipped special token gets no output-text entry (chat keeps its entry, as vLLM does)."""
    server, parser = silent_server
    chat = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, max_tokens=8)).content)["choices"][0]
    tokens = [e["token"] for e in chat["logprobs"]["content"]]
    assert tokens == ["a", "b", "c", END_THINK, "\n", SEP, "0", "1"]
    body = {"model": server.model_dir.name, "input": "<think>", "max_output_tokens": 8,
            "temperature": 0.0, "include": ["message.output_text.logprobs"]}
    whole = strict_json(post(server, "/v1/responses", body).content)
    part = whole["output"][-1]["content"][0]
    assert part["text"] == ("\n01" if parser else "abc</think>\n01")
    expected = ["\n", "0", "1"] if parser else ["a", "b", "c", END_THINK, "\n", "0", "1"]
    assert [e["token"] for e in part["logprobs"]] == expected
    events = response_events(post(server, "/v1/responses", {**body, "stream": True}))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["token"] for d in deltas for e in d["logprobs"]] == expected


def test_reasoning_effort_reaches_the_chat_template(ending_server):
    """Chat's reasoning_effort and the Responses API's reasoning.effort are the template's
    `reasoning_effort` (this template writes it before the messages: "low" is 3 more prompt
    tokens); a Responses reasoning input item (an earlier turn's) is skipped; the Response
    reports the settings; an unknown effort is refused naming the field."""
    server = ending_server
    plain = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, max_tokens=2)).content)
    low = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, max_tokens=2, reasoning_effort="low")).content)
    assert low["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 3
    body = {"model": server.model_dir.name, "max_output_tokens": 2, "temperature": 0.0}
    history = [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "<think>"}]},
               {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed"}]
    whole = strict_json(post(server, "/v1/responses", {
        **body, "input": history, "reasoning": {"effort": "low"}}).content)
    assert whole["usage"]["input_tokens"] == low["usage"]["prompt_tokens"]
    assert whole["reasoning"] == {"effort": "low", "summary": None, "generate_summary": None}
    for route, fields, param in [
        ("/v1/chat/completions", chat_body(server, reasoning_effort="extreme"),
         "reasoning_effort"),
        ("/v1/responses", {**body, "input": "<think>", "reasoning": {"effort": "extreme"}},
         "reasoning"),
        ("/v1/responses", {**body, "input": "<think>", "reasoning": {"summary": "long"}},
         "reasoning"),
    ]:
        refused = post(server, route, fields)
        assert refused.status_code == 400, refused.text
        assert strict_json(refused.content)["error"]["param"] == param


def test_usage_counts_the_reasoning_tokens(ending_server):
    """vLLM's usage.completion_tokens_details.reasoning_tokens (chat, whole and streamed) and
    the Responses API's output_tokens_details: the generated tokens before the end string,
    which itself is not counted; without an end string every generated token."""
    server = ending_server
    end_id = encode(server.model_dir, END_THINK)[0]
    for max_tokens in (8, 2):
        fields = dict(max_tokens=max_tokens, return_token_ids=True)
        whole = strict_json(post(server, "/v1/chat/completions", chat_body(server, **fields)
                                 ).content)
        ids = whole["choices"][0]["token_ids"]
        expected = ids.index(end_id) if end_id in ids else len(ids)
        assert expected == (3 if max_tokens == 8 else 2)
        usage = whole["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}
        assert usage["completion_tokens"] == len(ids) == max_tokens
        events = sse_events(post(server, "/v1/chat/completions", chat_body(
            server, stream=True, stream_options={"include_usage": True}, **fields)))
        assert events[-1]["choices"] == [] and events[-1]["usage"] == usage
        response = strict_json(post(server, "/v1/responses", {
            "model": server.model_dir.name, "input": "<think>", "temperature": 0.0,
            "max_output_tokens": max_tokens}).content)
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == expected


def test_usage_details_only_with_a_reasoning_parser(silent_server):
    server, parser = silent_server
    usage = strict_json(post(server, "/v1/chat/completions", chat_body(
        server, max_tokens=8)).content)["usage"]
    assert ("completion_tokens_details" in usage) == (parser is not None)
    if parser is not None:
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    completion = strict_json(post(server, "/v1/completions", body(
        server, thinking_token_budget=None)).content)["usage"]
    assert "completion_tokens_details" not in completion


def test_a_prompt_that_closes_its_thinking_span_gets_only_content(thinking_server):
    """vLLM's prompt_is_reasoning_end: a prompt whose last delimiter is the end string (Qwen3's
    template with enable_thinking false ends it with <think></think>) makes the whole output
    content, streamed or not, with null reasoning, no reasoning tokens, and every Responses
    entry."""
    server = thinking_server
    closed = {"model": server.model_dir.name, "temperature": 0.0, "ignore_eos": True,
              "messages": [{"role": "user", "content": "<think>" + END_THINK}],
              "max_tokens": 4, "logprobs": True}
    whole = strict_json(post(server, "/v1/chat/completions", closed).content)
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "\n012")
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    events = sse_events(post(server, "/v1/chat/completions", {**closed, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n012"
    response = strict_json(post(server, "/v1/responses", {
        "model": server.model_dir.name, "input": "<think>" + END_THINK, "temperature": 0.0,
        "max_output_tokens": 4, "include": ["message.output_text.logprobs"]}).content)
    [item] = response["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "\n012"
    assert [e["token"] for e in item["content"][0]["logprobs"]] == ["\n", "0", "1", "2"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    # A span the prompt opens again is reasoning as before.
    reopened = {**closed, "messages": [{"role": "user",
                                        "content": "<think>" + END_THINK + "<think>"}]}
    message = strict_json(post(server, "/v1/chat/completions", reopened).content)[
        "choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("abcd", None)
