"""Reasoning and tool calls end to end, with the official openai client at TP1 and TP2, on a
scripted checkpoint (tests/scripted_checkpoint.py) whose output is known: after a prompt that
ends with <think> (the start inside the template, as deepseek_r1 expects) it writes

    ab</think>\\nd<tool_call>{"name":"w","arguments":{"c":"p"}}</tool_call>  <eos>

(a trailing space before <eos>). vLLM's deepseek_r1 + hermes parsing makes that reasoning
"ab", content "\\nd" and one call w({"c": "p"}); the space after the call is stripped. Chat
reports an entry for every generated token; the Responses API's output text only for the two
content tokens. Values against transformers; streamed equal to whole."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from tests.scripted_checkpoint import (
    END_THINK,
    END_TOOL_CALL,
    EOS,
    THINK,
    TOOL_CALL,
    write_scripted,
)
from tests.server.helpers import (
    ROOT,
    TOLERANCE,
    chat_prompt_ids,
    hf_rows,
    launch,
    post,
    response_events,
    strict_json,
)

pytestmark = pytest.mark.slow

OPEN, ARGS, COLON, CLOSE = '{"name":"', '","arguments":{"', '":"', '"}}'
SCRIPT = ["a", "b", END_THINK, "Ċ", "d", TOOL_CALL, OPEN, "w", ARGS, "c", COLON, "p", CLOSE,
          END_TOOL_CALL, "Ġ"]
"""The generated tokens, in order (then <eos>)."""
TEXT = 'ab</think>\nd<tool_call>{"name":"w","arguments":{"c":"p"}}</tool_call> '
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>"
MESSAGES = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {
    "name": "w", "description": "weather", "parameters": {
        "type": "object", "properties": {"c": {"type": "string"}}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "w", "description": "weather",
                    "parameters": TOOLS[0]["function"]["parameters"], "strict": False}]
INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tool_server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tools-tp{request.param}")
    chain = [THINK, *SCRIPT, EOS]
    successors = dict(itertools.pairwise(chain))
    model_dir = write_scripted(root / "model", successors,
                               extra=(TOOL_CALL, END_TOOL_CALL, OPEN, ARGS, COLON, CLOSE))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    flags = ["--capacity", "2", "--reasoning-parser", "deepseek_r1",
             "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    server = launch(f"tools-tp{request.param}", model_dir, request.param, flags, root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def chat_kwargs(server, **extra):
    return dict(model=server.model_dir.name, messages=MESSAGES, max_tokens=32, temperature=0.0,
                logprobs=True, top_logprobs=2, tools=TOOLS,
                extra_body={"return_token_ids": True}, **extra)


def token_id(server, piece: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(server.model_dir / "tokenizer.json")).token_to_id(piece)


def generated_ids(server) -> list[int]:
    return [token_id(server, piece) for piece in SCRIPT]


def check_values(server, entries, ids: list[int], at: list[int]) -> None:
    """Entry i is generated token at[i]'s: its logprob and best alternative against
    transformers' log_softmax row."""
    rows = hf_rows(server.model_dir, chat_prompt_ids(server.model_dir, MESSAGES), ids)
    assert len(entries) == len(at)
    for entry, index in zip(entries, at, strict=True):
        row = rows[index]
        assert math.isclose(entry.logprob, float(row[ids[index]]), abs_tol=TOLERANCE)
        assert math.isclose(entry.top_logprobs[0].logprob, float(row.max()), abs_tol=TOLERANCE)


def test_chat_splits_reasoning_content_and_tool_call(tool_server):
    server = tool_server
    response = server.client().chat.completions.create(**chat_kwargs(server))
    choice = response.choices[0]
    ids = generated_ids(server)
    # The script, then the terminating <eos> (return_token_ids includes it; it has no entry).
    assert choice.model_extra["token_ids"] == [*ids, token_id(server, EOS)]
    message = choice.message
    assert message.model_extra["reasoning"] == "ab"
    assert message.content == "\nd"
    (call,) = message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "w" and json.loads(call.function.arguments) == {"c": "p"}
    assert choice.finish_reason == "tool_calls"
    # vLLM's chat logprobs: an entry per generated token, reasoning and tool data included.
    check_values(server, choice.logprobs.content, ids, list(range(len(ids))))


def test_chat_stream_equals_whole(tool_server):
    server = tool_server
    whole = server.client().chat.completions.create(**chat_kwargs(server)).choices[0]
    chunks = list(server.client().chat.completions.create(stream=True, **chat_kwargs(server)))
    deltas = [c.choices[0] for c in chunks if c.choices]
    reasoning = "".join(d.delta.model_extra.get("reasoning") or "" for d in deltas)
    content = "".join(d.delta.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.delta.tool_calls or ()]
    entries = [e for d in deltas if d.logprobs for e in d.logprobs.content]
    assert (reasoning, content) == ("ab", "\nd")
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "w", whole.message.tool_calls[0].function.arguments)]
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert deltas[-1].finish_reason == "tool_calls"
    assert [e.token for e in entries] == [e.token for e in whole.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(
        [e.logprob for e in whole.logprobs.content], abs=1e-6)


def test_tool_choice_none_leaves_the_call_in_the_content(tool_server):
    server = tool_server
    choice = server.client().chat.completions.create(
        **chat_kwargs(server, tool_choice="none")).choices[0]
    assert choice.message.content == TEXT[len("ab</think>"):]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


def responses_kwargs(server, **extra):
    return dict(model=server.model_dir.name, input="x", max_output_tokens=32, temperature=0.0,
                top_logprobs=2, include=INCLUDE, tools=RESPONSES_TOOLS, **extra)


def test_responses_items_and_content_entries(tool_server):
    server = tool_server
    response = server.client().responses.create(**responses_kwargs(
        server, tool_choice="auto", parallel_tool_calls=False))
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content[0].text == "ab"
    assert message.content[0].text == "\nd"
    assert call.name == "w" and json.loads(call.arguments) == {"c": "p"} and call.call_id
    assert response.status == "completed"
    assert (response.tool_choice, response.parallel_tool_calls) == ("auto", False)
    assert [t.name for t in response.tools] == ["w"]
    # Entries exactly for the tokens whose first byte is content: "\n" and "d" (generated
    # tokens 3 and 4); reasoning, delimiters, tool data and the stripped space get none.
    entries = message.content[0].logprobs
    assert [e.token for e in entries] == ["\n", "d"]
    check_values(server, entries, generated_ids(server), [3, 4])


def test_responses_stream_equals_whole(tool_server):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    server = tool_server
    body = {**responses_kwargs(server), "stream": True}
    events = response_events(post(server, "/v1/responses", body))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert "response.reasoning_text.delta" in kinds
    final = Response.model_validate(events[-1]["response"])
    whole = Response.model_validate(strict_json(post(server, "/v1/responses", {
        **body, "stream": False}).content))

    def shape(output):
        out = []
        for item in output:
            if item.type == "function_call":
                out.append((item.type, item.name, item.arguments))
            elif item.type == "reasoning":
                out.append((item.type, item.content[0].text))
            else:
                part = item.content[0]
                out.append((item.type, part.text, [(e.token, round(e.logprob, 6))
                                                   for e in part.logprobs]))
        return out

    assert shape(final.output) == shape(whole.output)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry["token"] for d in deltas for entry in d["logprobs"]] == ["\n", "d"]


def test_top_logprobs_without_include_is_honoured(tool_server):
    server = tool_server
    kwargs = responses_kwargs(server, tool_choice="none")
    del kwargs["include"]
    response = server.client().responses.create(**kwargs)
    (message,) = [item for item in response.output if item.type == "message"]
    entries = message.content[0].logprobs
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


def test_auto_tool_choice_without_a_parser_refuses_to_start(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.serve", "--model", str(tmp_path),
         "--enable-auto-tool-choice"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == ["helios: error: --enable-auto-tool-choice requires --tool-call-parser "
                     "(see helios_logprobs.launch.serve --help)"]
