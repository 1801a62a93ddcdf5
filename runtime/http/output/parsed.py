"""A choice's output through its parsers (runtime/text/parsers), on the chat wire.

`ParsedChoice.step(text, positions, final)` feeds the detokenizer's text to the parser and
returns the events plus the positions to report. Chat reports every position as it comes
(vLLM's: an entry per generated token, reasoning and tool calls included). With
`content_only` (the Responses API's output text) positions wait in an attribution queue and
come out, in order, only when their token's first character is content: reasoning, tool
data, stripped whitespace, delimiters and synthesized text get none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helios_logprobs.runtime.text.parsers.events import CONTENT, REASONING, Event, Piece, ToolCall
from helios_logprobs.runtime.text.parsers.pipeline import (
    Attribution,
    OutputParser,
    ParserSettings,
)


class ParsedChoice:
    def __init__(self, settings: ParserSettings, *, content_only: bool = False,
                 has_text: Callable[[Any], bool] = lambda position: True) -> None:
        self.parser = OutputParser(settings)
        self.attribution = Attribution(has_text) if content_only else None
        self.calls = 0

    def step(self, text: str, positions: list, final: bool) -> tuple[list[Event], list]:
        events = self.parser.feed(text, final)
        self.calls += sum(isinstance(e, ToolCall) for e in events)
        if self.attribution is None:
            return events, positions
        self.attribution.add(positions)
        self.attribution.note(events)
        released = self.attribution.release(self.parser.consumed)
        if final:
            released += self.attribution.finish()
        return events, released


def tool_call_wire(call: ToolCall, *, index: bool) -> dict[str, Any]:
    """vLLM's ToolCall (message) or DeltaToolCall (`index`: a stream's whole call)."""
    body = {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **body} if index else body


def texts(events: list[Event]) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of `events`."""
    parts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
    calls = []
    for event in events:
        if isinstance(event, Piece):
            parts[event.kind].append(event.text)
        else:
            calls.append(event)
    return "".join(parts[REASONING]), "".join(parts[CONTENT]), calls


def delta_body(events: list[Event], include_reasoning: bool) -> dict[str, Any]:
    """A chunk's delta: `reasoning`, `content`, `tool_calls` (whole calls, each with its
    index and id); `{"content": ""}` when the events hold nothing (text held back)."""
    reasoning, content, calls = texts(events)
    delta: dict[str, Any] = {}
    if reasoning and include_reasoning:
        delta["reasoning"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [tool_call_wire(call, index=True) for call in calls]
    return delta or {"content": ""}


def finish_reason(reason: str | None, calls: int, mode: str) -> str | None:
    """vLLM's: "tool_calls" once a call was made (tool_choice auto or required); a named
    function's call finishes as the output did (OpenAI's "stop")."""
    if reason is None or not calls or mode == "named":
        return reason
    return "tool_calls"
