"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it), through the chat path.

The request becomes a chat request: `instructions` as a system message, then the input items
(a string is one user message; message items keep their role, their text parts joined). The
one assistant message comes back as a Response whose `output_text` part carries the logprob
entries ({token, logprob, bytes, top_logprobs}, chat's) when `include` asks for
"message.output_text.logprobs", with `top_logprobs` alternatives (default 0). Streamed, the
events are OpenAI's: response.created, response.in_progress, the item and part openings, one
response.output_text.delta per chat chunk (its text and entries), then the done events and
response.completed (or response.incomplete at max_output_tokens). The closing events repeat
the whole part, so the stream keeps the part's text and entries until then: bounded by
max_output_tokens, nothing else is retained.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ranks.contract.requests import RequestError
from runtime.engine.client import EngineClient
from runtime.http.assets import ModelAssets
from runtime.http.chat import PreparedChat, chat, prepare_chat, stream_chat
from runtime.http.protocol.models import ChatCompletionRequest, ResponsesRequest
from runtime.http.responses import now

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
        if kind != "message":
            raise RequestError("input", f"input[{i}]: items of type {kind!r} are not supported")
        messages.append({"role": item.get("role"), "content": _text(item.get("content"),
                                                                    f"input[{i}]")})
    if not messages:
        raise RequestError("input", "the input has no items")
    return messages


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
    if req.reasoning is not None:
        raise RequestError("reasoning", "reasoning: reasoning controls are not supported")
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
            "top_logprobs": (req.top_logprobs or 0) if wants else None}
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


def _item_id(prep: PreparedResponses) -> str:
    return "msg_" + prep.id.removeprefix("resp_")


def _message(prep: PreparedResponses, status: str, parts: list) -> dict[str, Any]:
    return {"type": "message", "id": _item_id(prep), "status": status, "role": "assistant",
            "content": parts}


def _response(prep: PreparedResponses, assets: ModelAssets, status: str, output: list
              ) -> dict[str, Any]:
    src, usage = prep.source, prep.totals.usage()
    return {
        "id": prep.id, "object": "response", "created_at": prep.created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": src.instructions, "max_output_tokens": src.max_output_tokens,
        "metadata": src.metadata or {}, "model": assets.served_model_name, "output": output,
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
        "store": False, "temperature": 1.0 if src.temperature is None else src.temperature,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_logprobs": src.top_logprobs or 0,
        "top_p": 1.0 if src.top_p is None else src.top_p, "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "user": src.user,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def respond(prep: PreparedResponses, engine: EngineClient, assets: ModelAssets) -> dict:
    """The whole Response; raises EngineError (or another error) after admission."""
    body = await chat(prep.chat, engine, assets)
    choice = body["choices"][0]
    entries = (choice["logprobs"] or {}).get("content") or []
    status = _status(choice["finish_reason"])
    part = _part(choice["message"]["content"] or "", entries)
    return _response(prep, assets, status, [_message(prep, status, [part])])


async def stream_responses(prep: PreparedResponses, engine: EngineClient, assets: ModelAssets
                           ) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's Responses events for one streamed request (see the module docstring)."""
    sequence = 0
    item_id = _item_id(prep)

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal sequence
        sequence += 1
        return {"type": kind, "sequence_number": sequence - 1, **fields}

    place = {"item_id": item_id, "output_index": 0, "content_index": 0}
    opening = _response(prep, assets, "in_progress", [])
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    yield event("response.output_item.added", output_index=0,
                item=_message(prep, "in_progress", []))
    yield event("response.content_part.added", **place, part=_part("", []))
    texts: list[str] = []
    entries: list = []
    finish = None
    async for chunk in stream_chat(prep.chat, engine, assets):
        for choice in chunk.get("choices", ()):
            text = choice.get("delta", {}).get("content") or ""
            new = ((choice.get("logprobs") or {}).get("content")) or []
            finish = choice.get("finish_reason") or finish
            if text or new:
                texts.append(text)
                entries.extend(new)
                yield event("response.output_text.delta", **place, delta=text, logprobs=new)
    status, text = _status(finish), "".join(texts)
    part = _part(text, entries)
    yield event("response.output_text.done", **place, text=text, logprobs=entries)
    yield event("response.content_part.done", **place, part=part)
    item = _message(prep, status, [part])
    yield event("response.output_item.done", output_index=0, item=item)
    final = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(final, response=_response(prep, assets, status, [item]))
