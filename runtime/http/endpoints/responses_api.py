"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it), through the chat path.

The request becomes a chat request: `instructions` as a system message, then the input items
(a string is one user message; message items keep their role, their text parts joined). The
assistant message comes back as a Response whose `output_text` part carries the logprob
entries ({token, logprob, bytes, top_logprobs}, chat's) when `include` asks for
"message.output_text.logprobs", with `top_logprobs` alternatives (default 0). With a reasoning
parser, the reasoning text comes first as a `reasoning` item (vLLM's), and the message holds
the content and only the content tokens' entries (the contract). Streamed, the events are
OpenAI's: response.created, response.in_progress, then per output item its opening events,
one delta per chat chunk (response.reasoning_text.delta, or response.output_text.delta with
the chunk's entries) and its done events, then response.completed (or response.incomplete
at max_output_tokens). The closing events repeat the whole part, so the stream keeps the open
item's text and entries until then: bounded by max_output_tokens, nothing else is retained.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.client import EngineClient
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.endpoints.chat import (
    PreparedChat,
    chat,
    prepare_chat,
    stream_chat,
)
from helios_logprobs.runtime.http.protocol.models import (
    EFFORTS,
    SUMMARIES,
    ChatCompletionRequest,
    ResponsesRequest,
)
from helios_logprobs.runtime.http.responses import now

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")
CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "messages": "input"}
"""Chat's parameter names -> the Responses fields they come from (refusals name the latter)."""


@dataclass
class PreparedResponses:
    chat: PreparedChat
    source: ResponsesRequest
    id: str
    created: int

    @property
    def jobs(self):
        return self.chat.jobs

    @property
    def totals(self):
        return self.chat.totals

    @property
    def request(self) -> ChatCompletionRequest:
        return self.chat.request

    @property
    def mode(self):
        return self.chat.mode


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("input", f"{where}.content: expected text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError("input", f"{where}.content[{j}]: parts of type {kind!r} are "
                                        "not supported (text only)")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "reasoning":  # (an earlier turn's reasoning is not replayed)
            continue
        if kind != "message":
            raise RequestError("input", f"input[{i}]: items of type {kind!r} are not supported")
        messages.append({"role": item.get("role"), "content": _text(item.get("content"),
                                                                    f"input[{i}]")})
    if not messages:
        raise RequestError("input", "the input has no items")
    return messages


SUMMARY_KEYS = ("summary", "generate_summary")
TOP_LOGPROBS_LIMIT = 20
"""OpenAI's bound on top_logprobs, checked with or without the logprobs include."""


def _refusals(req: ResponsesRequest) -> None:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= TOP_LOGPROBS_LIMIT:
        raise RequestError("top_logprobs", f"top_logprobs must be between 0 and "
                                           f"{TOP_LOGPROBS_LIMIT}, got {top}")
    if req.tools:
        raise RequestError("tools", "tools: tool calling is not supported by this server")
    if req.previous_response_id is not None:
        raise RequestError("previous_response_id", "previous_response_id: responses are not "
                                                   "stored by this server")
    if req.background:
        raise RequestError("background", "background: background responses are not supported")
    reasoning = req.reasoning
    if reasoning is not None and (
            not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, *EFFORTS)
            or any(reasoning.get(key) not in (None, *SUMMARIES) for key in SUMMARY_KEYS)):
        raise RequestError("reasoning", f"reasoning: expected an object whose effort is one of "
                                        f"{', '.join(EFFORTS)} and whose summary is one of "
                                        f"{', '.join(SUMMARIES)} (or null), got {reasoning!r}")
    fmt = (req.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("text", "text.format: only the text format is supported")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req` (RequestError names the Responses field)."""
    _refusals(req)
    wants = LOGPROBS_INCLUDE in (req.include or [])
    body = {"model": req.model, "messages": _messages(req), "stream": req.stream,
            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "logprobs": wants,
            "top_logprobs": (req.top_logprobs or 0) if wants else None,
            "reasoning_effort": (req.reasoning or {}).get("effort")}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first.get("loc", ("input",))[0])
        param = CHAT_TO_RESPONSES.get(field, field)
        raise RequestError(param, f"{param}: {first.get('msg', 'invalid')}") from exc


def prepare_responses(req: ResponsesRequest, engine: EngineClient, assets: ModelAssets
                      ) -> PreparedResponses:
    try:
        # Output text and its entries are the content's: reasoning, delimiters get none.
        prepared = prepare_chat(chat_request(req), engine, assets, content_entries_only=True)
    except RequestError as exc:
        param = CHAT_TO_RESPONSES.get(exc.param)
        if param is None:
            raise
        raise RequestError(param, exc.message.replace(exc.param, param)) from exc
    return PreparedResponses(prepared, req, f"resp_{uuid.uuid4().hex}", now())


def _part(text: str, entries: list) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}


def _message(item_id: str, status: str, parts: list) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": parts}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _reasoning(item_id: str, status: str, parts: list) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": parts}


def _output(prep: PreparedResponses, status: str, reasoning: str | None, content: str,
            entries: list) -> list[dict[str, Any]]:
    """vLLM's output items: the reasoning (when there is any), then the message (when it has
    text, or when nothing else would be output)."""
    items = []
    if reasoning:
        items.append(_reasoning(_item_id(prep, "rs_"), "completed" if content else status,
                                [_reasoning_part(reasoning)]))
    if content or not items:
        items.append(_message(_item_id(prep, "msg_"), status, [_part(content, entries)]))
    return items


def _item_id(prep: PreparedResponses, prefix: str) -> str:
    return prefix + prep.id.removeprefix("resp_")

def _response(prep: PreparedResponses, assets: ModelAssets, status: str, output: list
              ) -> dict[str, Any]:
    src, usage = prep.source, prep.totals.usage()
    sampling = prep.jobs[0].params  # (the sampling the choice ran with: model defaults too)
    return {
        "id": prep.id, "object": "response", "created_at": prep.created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": src.instructions, "max_output_tokens": src.max_output_tokens,
        "metadata": src.metadata or {}, "model": assets.served_model_name, "output": output,
        "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": _reasoning_echo(src.reasoning),
        "store": False, "temperature": sampling.sampled_temperature,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_logprobs": src.top_logprobs or 0,
        "top_p": sampling.top_p, "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": prep.totals.reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        },
        "user": src.user,
    }


def _reasoning_echo(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    """The request's reasoning settings as the Response reports them (no summary is made)."""
    if reasoning is None:
        return None
    return {key: reasoning.get(key) for key in ("effort", "summary", "generate_summary")}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def respond(prep: PreparedResponses, engine: EngineClient, assets: ModelAssets) -> dict:
    """The whole Response; raises EngineError (or another error) after admission."""
    body = await chat(prep.chat, engine, assets)
    choice = body["choices"][0]
    entries = (choice["logprobs"] or {}).get("content") or []
    status = _status(choice["finish_reason"])
    message = choice["message"]
    output = _output(prep, status, message.get("reasoning"), message["content"] or "", entries)
    return _response(prep, assets, status, output)


class _StreamedItems:
    """The output items of a stream, opened as their text arrives: a reasoning item while the
    chat deltas carry `reasoning`, then the message. Each closing event repeats its item's
    whole text, so an open item keeps its text (and entries) until it closes."""

    def __init__(self, prep: PreparedResponses) -> None:
        self.prep = prep
        self.done: list[dict[str, Any]] = []
        self.kind: str | None = None
        self.texts: list[str] = []
        self.entries: list = []

    def _place(self) -> dict[str, Any]:
        prefix = "rs_" if self.kind == "reasoning" else "msg_"
        return {"item_id": _item_id(self.prep, prefix), "output_index": len(self.done),
                "content_index": 0}

    def add(self, kind: str, text: str, entries: list) -> list[tuple[str, dict[str, Any]]]:
        """The events of one delta of `kind` ("reasoning" or "message")."""
        events = [] if kind == self.kind else self._open(kind)
        self.texts.append(text)
        self.entries.extend(entries)
        if kind == "reasoning":
            return [*events, ("response.reasoning_text.delta", {**self._place(), "delta": text})]
        return [*events, ("response.output_text.delta",
                          {**self._place(), "delta": text, "logprobs": entries})]

    def finish(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        """The closing events: the open item's, or an empty message when nothing was output."""
        events = [] if self.done or self.kind else self._open("message")
        return [*events, *self._close(status)]

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close("completed") if self.kind else []
        self.kind, self.texts, self.entries = kind, [], []
        place = self._place()
        if kind == "reasoning":
            item, part = _reasoning(place["item_id"], "in_progress", []), _reasoning_part("")
        else:
            item, part = _message(place["item_id"], "in_progress", []), _part("", [])
        return [*events,
                ("response.output_item.added", {"output_index": place["output_index"],
                                                "item": item}),
                ("response.content_part.added", {**place, "part": part})]

    def _close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        if self.kind is None:
            return []
        place, text = self._place(), "".join(self.texts)
        if self.kind == "reasoning":
            part = _reasoning_part(text)
            item = _reasoning(place["item_id"], status, [part])
            last = ("response.reasoning_text.done", {**place, "text": text})
        else:
            part = _part(text, self.entries)
            item = _message(place["item_id"], status, [part])
            last = ("response.output_text.done", {**place, "text": text,
                                                  "logprobs": self.entries})
        self.done.append(item)
        self.kind = None
        return [last, ("response.content_part.done", {**place, "part": part}),
                ("response.output_item.done", {"output_index": place["output_index"],
                                               "item": item})]


async def stream_responses(prep: PreparedResponses, engine: EngineClient, assets: ModelAssets
                           ) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's Responses events for one streamed request (see the module docstring)."""
    sequence = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal sequence
        sequence += 1
        return {"type": kind, "sequence_number": sequence - 1, **fields}

    opening = _response(prep, assets, "in_progress", [])
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    items = _StreamedItems(prep)
    finish = None
    async for chunk in stream_chat(prep.chat, engine, assets):
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            new = ((choice.get("logprobs") or {}).get("content")) or []
            finish = choice.get("finish_reason") or finish
            pending = []
            if delta.get("reasoning"):
                pending += items.add("reasoning", delta["reasoning"], [])
            if delta.get("content") or new:
                pending += items.add("message", delta.get("content") or "", new)
            for kind, fields in pending:
                yield event(kind, **fields)
    status = _status(finish)
    for kind, fields in items.finish(status):
        yield event(kind, **fields)
    final = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(final, response=_response(prep, assets, status, items.done))
