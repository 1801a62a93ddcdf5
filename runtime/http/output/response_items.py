"""The Responses API's output items, built from a choice's parser events in output order.

One fold serves the whole response and the stream: `ResponseItems.step(events, entries)`
opens an item when text of another kind (or a tool call) arrives, closing the open one,
and returns OpenAI's streamed events; `done` holds the closed items, which are the whole
response's `output`. So a stream and a whole response have the same items, in the same
order: a `reasoning` item, a `message` item (its `output_text` part carries the entries of
the content tokens), `function_call` items, and a further message when content follows a
call. Each closing event repeats its item's whole text, so an open item keeps its text and
entries until it closes (bounded by max_output_tokens); nothing else is retained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helios_logprobs.runtime.text.parsers.events import REASONING, Event, ToolCall

Events = list[tuple[str, dict[str, Any]]]


def output_text_part(text: str, entries: list) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}


def message_item(item_id: str, status: str, parts: list) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": parts}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, status: str, parts: list) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": parts}


def function_call_item(item_id: str, status: str, call: ToolCall, arguments: str
                       ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id,
            "name": call.name, "arguments": arguments, "status": status}


PREFIXES = {REASONING: "rs_", "message": "msg_", "function_call": "fc_"}


class ResponseItems:
    """`base`: the response id's hex (item ids are `<prefix><base>`, then `_<n>` for the
    n-th output). `entries(positions)`: the wire entries of content positions."""

    def __init__(self, base: str, entries: Callable[[list], list]) -> None:
        self.base = base
        self.to_entries = entries
        self.done: list[dict[str, Any]] = []
        self.kind: str | None = None
        self.texts: list[str] = []
        self.entries: list = []

    def _place(self, kind: str | None = None) -> dict[str, Any]:
        index = len(self.done)
        suffix = f"_{index}" if index else ""
        return {"item_id": PREFIXES[kind or self.kind] + self.base + suffix,
                "output_index": index, "content_index": 0}

    def step(self, events: list[Event], positions: list) -> Events:
        """The streamed events of one step; `positions` are the step's released content
        positions, in order (each goes with the content piece its offset lies in)."""
        out: Events = []
        pending = list(positions)
        for event in events:
            if isinstance(event, ToolCall):
                out += self._call(event)
            elif event.kind == REASONING:
                out += self._text(REASONING, event.text, [])
            else:
                taken = 0
                end = event.end if event.start is not None else None
                while taken < len(pending) and (end is None or pending[taken].text_offset < end):
                    taken += 1
                out += self._text("message", event.text, pending[:taken])
                pending = pending[taken:]
        if pending:  # (entries whose text went out before them: they join the open message)
            out += self._text("message", "", pending)
        return out

    def finish(self, status: str) -> Events:
        """The closing events: the open item's, or an empty message when nothing was output."""
        events = [] if self.done or self.kind else self._open("message")
        return [*events, *self._close(status)]

    def _text(self, kind: str, text: str, positions: list) -> Events:
        if not text and not positions:
            return []
        events = [] if kind == self.kind else self._open(kind)
        entries = self.to_entries(positions) if positions else []
        self.texts.append(text)
        self.entries.extend(entries)
        place = self._place()
        if kind == REASONING:
            return [*events, ("response.reasoning_text.delta", {**place, "delta": text})]
        return [*events, ("response.output_text.delta",
                          {**place, "delta": text, "logprobs": entries})]

    def _call(self, call: ToolCall) -> Events:
        events = self._close("completed") if self.kind else []
        place = self._place("function_call")
        del place["content_index"]
        opening = function_call_item(place["item_id"], "in_progress", call, "")
        item = {**opening, "arguments": call.arguments, "status": "completed"}
        self.done.append(item)
        return [*events,
                ("response.output_item.added", {"output_index": place["output_index"],
                                                "item": opening}),
                ("response.function_call_arguments.delta", {**place, "delta": call.arguments}),
                ("response.function_call_arguments.done", {**place, "name": call.name,
                                                           "arguments": call.arguments}),
                ("response.output_item.done", {"output_index": place["output_index"],
                                               "item": item})]

    def _open(self, kind: str) -> Events:
        events = self._close("completed") if self.kind else []
        self.kind, self.texts, self.entries = kind, [], []
        place = self._place()
        if kind == REASONING:
            item, part = reasoning_item(place["item_id"], "in_progress", []), reasoning_part("")
        else:
            item, part = message_item(place["item_id"], "in_progress", []), output_text_part(
                "", [])
        return [*events,
                ("response.output_item.added", {"output_index": place["output_index"],
                                                "item": item}),
                ("response.content_part.added", {**place, "part": part})]

    def _close(self, status: str) -> Events:
        if self.kind is None:
            return []
        place, text = self._place(), "".join(self.texts)
        if self.kind == REASONING:
            part = reasoning_part(text)
            item = reasoning_item(place["item_id"], status, [part])
            last = ("response.reasoning_text.done", {**place, "text": text})
        else:
            part = output_text_part(text, self.entries)
            item = message_item(place["item_id"], status, [part])
            last = ("response.output_text.done", {**place, "text": text,
                                                  "logprobs": self.entries})
        self.done.append(item)
        self.kind = None
        return [last, ("response.content_part.done", {**place, "part": part}),
                ("response.output_item.done", {"output_index": place["output_index"],
                                               "item": item})]
