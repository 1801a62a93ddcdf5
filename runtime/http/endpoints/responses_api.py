"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it), through the chat path.

The request becomes a chat request: `instructions` as a system message, then the input items
(a string is one user message; message items keep their role, their text parts joined;
`function_call` items become an assistant message with tool_calls and
`function_call_output` items tool messages). `tools` (OpenAI's flat function tools),
`tool_choice` and `parallel_tool_calls` go to chat's tools (protocol/tools.py) and come
back echoed as asked. The output is parsed by the choice's parsers (reasoning, tool calls)
and folded into output items (runtime/http/output/response_items.py): `reasoning`, `message`
and `function_call` items, in output order, the same whole or streamed. The `output_text`
part carries the logprob entries ({token, logprob, bytes, top_logprobs}, chat's) of exactly
the tokens whose first text byte lies in a content source range, when `include` asks for
"message.output_text.logprobs" or `top_logprobs` > 0 asks for alternatives; with
`return_entropy` (chat's, SGLang's name) each entry also has its position's `entropy`.
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
    PARSED_KEY,
    PreparedChat,
    choice_parser,
    prepare_chat,
    stream_chat,
)
from helios_logprobs.runtime.http.output.choices import collect
from helios_logprobs.runtime.http.output.parsed import finish_reason
from helios_logprobs.runtime.http.output.response_items import ResponseItems
from helios_logprobs.runtime.http.output.wire import chat_logprobs
from helios_logprobs.runtime.http.protocol.models import (
    EFFORTS,
    SUMMARIES,
    ChatCompletionRequest,
    ResponsesRequest,
)
from helios_logprobs.runtime.http.responses import now
from helios_logprobs.runtime.structured.request_fields import (
    chat_response_format,
    text_format_spec,
)

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


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise RequestError("input", f"{where}.{key}: expected a non-empty string")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier turn's function_call item as a chat tool call."""
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "reasoning":  # (an earlier turn's reasoning is not replayed)
            continue
        if kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str)
                             else _text(output, where)})
            continue
        if kind != "message":
            raise RequestError("input", f"{where}: items of type {kind!r} are not supported")
        messages.append({"role": item.get("role"), "content": _text(item.get("content"),
                                                                    where)})
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
    if req.return_entropy and not wants_entries(req):
        raise RequestError("return_entropy", f"return_entropy: the entropy is reported beside "
                                             f"each logprob entry: include "
                                             f"{LOGPROBS_INCLUDE!r} or set top_logprobs > 0")
    text_format_spec(req.text)  # (text.format: a 400 naming it, before the chat request)


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """OpenAI's Responses function tools ({"type": "function", "name", "parameters", ...})
    as chat tools; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError("tools", f"tools[{i}]: tools of type {kind!r} are not supported "
                                        "(function tools only)")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' {"type": "function", "name": X} is chat's {"type": "function",
    "function": {"name": X}}; the string modes are the same."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def wants_entries(req: ResponsesRequest) -> bool:
    """Entries are reported with the include, or when top_logprobs > 0 asks for alternatives
    (a request for alternatives is honoured rather than answered with empty lists)."""
    return LOGPROBS_INCLUDE in (req.include or []) or (req.top_logprobs or 0) > 0


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req` (RequestError names the Responses field)."""
    _refusals(req)
    wants = wants_entries(req)
    body = {"model": req.model, "messages": _messages(req), "stream": req.stream,
            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "logprobs": wants,
            "top_logprobs": (req.top_logprobs or 0) if wants else None,
            "reasoning_effort": (req.reasoning or {}).get("effort"),
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req.text),
            "return_entropy": req.return_entropy}
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


def _items(prep: PreparedResponses, assets: ModelAssets) -> ResponseItems:
    mode = prep.mode

    def entries(positions: list) -> list:
        if mode is None:
            return []
        return chat_logprobs(positions, assets.token_bytes, mode)["content"]

    return ResponseItems(prep.id.removeprefix("resp_"), entries)


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
        "parallel_tool_calls": True if src.parallel_tool_calls is None
        else src.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": _reasoning_echo(src.reasoning),
        "store": False, "temperature": sampling.sampled_temperature,
        "text": {"format": (src.text or {}).get("format") or {"type": "text"}},
        "tool_choice": "auto" if src.tool_choice is None else src.tool_choice,
        "tools": src.tools or [],
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
    (out,) = await collect(prep.jobs, engine, assets, prep.totals, {})
    parsed = choice_parser(prep.chat, assets.token_bytes)
    assert parsed is not None  # (content_entries_only: always parsed)
    events, positions = parsed.step(out.text, out.positions, final=True)
    finish = finish_reason(out.finish_reason, parsed.calls, prep.chat.tool_use.mode)
    status = _status(finish)
    items = _items(prep, assets)
    items.step(events, positions)
    items.finish(status)
    return _response(prep, assets, status, items.done)


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
    items = _items(prep, assets)
    finish = None
    async for chunk in stream_chat(prep.chat, engine, assets):
        for choice in chunk.get("choices", ()):
            finish = choice.get("finish_reason") or finish
            events, positions = choice.get(PARSED_KEY, ([], []))
            for kind, fields in items.step(events, positions):
                yield event(kind, **fields)
    status = _status(finish)
    for kind, fields in items.finish(status):
        yield event(kind, **fields)
    final = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(final, response=_response(prep, assets, status, items.done))
