"""Tool use on the request side (protocol/tools.py: vLLM's rules for tools, tool_choice and
the server flags), the forced-call parsers, and the Responses items folded from parser
events (the same items whatever the steps)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from helios_logprobs.launch.serve_options import TOOL_CALL_PARSERS
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.http.output.response_items import ResponseItems
from helios_logprobs.runtime.http.protocol.tools import (
    ToolServing,
    check_tools,
    constrained,
    resolve_tool_use,
)
from helios_logprobs.runtime.text.parsers.events import ToolCall
from helios_logprobs.runtime.text.parsers.pipeline import (
    Attribution,
    OutputParser,
    ParserSettings,
)
from helios_logprobs.runtime.text.parsers.tool_parsers import TOOL_PARSERS
from helios_logprobs.runtime.text.reasoning import ReasoningStrings

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]
SERVING = ToolServing("hermes", auto=True)


def test_the_flag_lists_every_parser():
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)


@pytest.mark.parametrize(("tools", "choice", "serving", "param"), [
    (TOOLS, None, ToolServing(), "tools"),  # the default "auto" needs the flags
    (TOOLS, "auto", ToolServing(), "tools"),
    (TOOLS, {"type": "function", "function": {"name": "g"}}, SERVING, "tool_choice"),
    (TOOLS, {"type": "function"}, SERVING, "tool_choice"),
])
def test_refusals_name_the_field(tools, choice, serving, param):
    with pytest.raises(RequestError) as caught:
        resolve_tool_use(tools, choice, None, serving)
    assert caught.value.param == param


@pytest.mark.parametrize("tools", [{"f": 1}, [{"type": "function"}],
                                   [{"type": "function", "function": {"name": ""}}],
                                   [{"type": "code", "function": {"name": "f"}}],
                                   [{"type": "function", "function": {"name": "f",
                                                                      "parameters": []}}]])
def test_malformed_tools_are_refused(tools):
    with pytest.raises(RequestError) as caught:
        check_tools(tools)
    assert caught.value.param == "tools"


def test_modes():
    assert resolve_tool_use(TOOLS, None, None, SERVING).mode == "auto"
    assert resolve_tool_use(TOOLS, "none", None, ToolServing()).mode == "none"
    assert resolve_tool_use(None, None, False, ToolServing()).parallel is False
    with pytest.raises(ValueError):
        ToolServing(None, auto=True)


@dataclass(frozen=True)
class Params:
    max_tokens: int = 4


def test_forced_calls_build_the_structured_constraint_or_refuse():
    """tool_choice required / named: runtime.structured's schema; an engine whose
    SamplingParams take no constraint cannot honour it, so 400 naming tool_choice."""
    use = resolve_tool_use(TOOLS, "required", None, ToolServing())
    assert use.mode == "required"
    schema = use.constraint.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1
    named = resolve_tool_use(TOOLS, {"type": "function", "function": {"name": "f"}}, None,
                             ToolServing())
    assert (named.mode, named.name) == ("named", "f")
    assert named.constraint.schema() == TOOLS[0]["function"]["parameters"]
    with pytest.raises(RequestError) as caught:
        constrained(Params(), use)
    assert caught.value.param == "tool_choice"
    from helios_logprobs.runtime.engine.client import SamplingParams

    assert constrained(SamplingParams(), use).structured == use.constraint
    assert constrained(SamplingParams(), named).structured == named.constraint
    with pytest.raises(RequestError) as caught:  # (with response_format's constraint too)
        constrained(SamplingParams(structured=named.constraint), use)
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize(("settings", "text", "expected"), [
    (ParserSettings(tool_parser="required"), '[{"name": "f", "parameters": {"a": 1}}]',
     [("f", {"a": 1})]),
    (ParserSettings(tool_parser="required"), '[{"name": "f"}]', None),
    (ParserSettings(tool_parser="named", tool_name="f"), '{"a": 2}', [("f", {"a": 2})]),
])
def test_forced_call_parsers(settings, text, expected):
    parser = OutputParser(settings)
    events = [*parser.feed(text[:3]), *parser.feed(text[3:], final=True)]
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    if expected is None:
        assert calls == [] and "".join(e.text for e in events) == text
    else:
        assert calls == expected


@dataclass(frozen=True)
class Position:
    token: str
    text_offset: int


def fold(text: str, cuts: list[int]):
    """Feed `text` cut at `cuts`, one token per character (offset = index), through the
    parsers and the items fold; returns the items without their random call ids."""
    settings = ParserSettings(ReasoningStrings("<think>", "</think>"), tool_parser="hermes")
    parser, queue = OutputParser(settings), Attribution()
    items = ResponseItems("x", lambda positions: [p.token for p in positions])
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        queue.add(Position(text[k], k) for k in range(a, b))
        events = parser.feed(text[a:b], final=i == len(bounds) - 2)
        queue.note(events)
        released = queue.release(parser.consumed)
        if i == len(bounds) - 2:
            released += queue.finish()
        items.step(events, released)
    items.finish("completed")
    for item in items.done:
        item.pop("call_id", None)
    return items.done


def test_items_are_the_same_whatever_the_steps():
    text = ('<think>hm</think>Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}'
            '</tool_call>\nDone')
    whole = fold(text, [])
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call",
                                                "message"]
    assert whole[1]["content"][0]["logprobs"] == list("Sure.")
    assert whole[3]["content"][0]["logprobs"] == list("Done")
    assert len({item["id"] for item in whole}) == 4
    for cuts in ([5], [9, 20], list(range(1, len(text), 3)), list(range(1, len(text)))):
        assert fold(text, cuts) == whole
