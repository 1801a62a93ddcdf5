"""POST /v1/chat/completions in vLLM's wire format (non-streaming and SSE).

`prompt_logprobs: N` (a server started with --prompt-logprobs) scores the rendered
conversation once (choice 0's engine request) and returns vLLM's top-level `prompt_logprobs`
list. Streams carry it, in prompt order, on top-level `prompt_logprobs` fields of choice 0's
first chunks (vLLM refuses prompt_logprobs > 0 with stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.ranks.contract.requests import (
    RequestError,
    check_logprob_request,
    check_token_ids_given,
)
from helios_logprobs.runtime.engine.client import EngineClient
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.output.choice_stream import ChoiceJob, Delta, Totals
from helios_logprobs.runtime.http.output.choices import collect, envelope, stream_chunks
from helios_logprobs.runtime.http.output.parsed import (
    ParsedChoice,
    delta_body,
    finish_reason,
    texts,
    tool_call_wire,
)
from helios_logprobs.runtime.http.output.wire import (
    Position,
    chat_logprobs,
    request_prompt_logprobs,
)
from helios_logprobs.runtime.http.protocol.messages import ChatMessage, parse_messages
from helios_logprobs.runtime.http.protocol.models import ChatCompletionRequest
from helios_logprobs.runtime.http.protocol.params import (
    bad_word_ids,
    build_params,
    capped_max_tokens,
    check_choices,
    check_request,
    check_stops,
    choice_seed,
    resolve_max_tokens,
    truncate,
    truncation,
    wire_mode,
)
from helios_logprobs.runtime.http.protocol.tools import (
    ToolUse,
    check_tools,
    constrained,
    resolve_tool_use,
)
from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.text.chat_template import ChatTemplateError
from helios_logprobs.runtime.text.parsers.pipeline import ParserSettings
from helios_logprobs.runtime.text.reasoning import ReasoningStrings, prompt_ends_reasoning
from helios_logprobs.runtime.text.token_bytes import TokenBytes

RESERVED_TEMPLATE_KEYS = {"messages", "add_generation_prompt"}
PARSED_KEY = "_parsed"
"""A streamed choice's (events, released content positions) for the Responses API."""


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    messages: list[ChatMessage]
    jobs: list[ChoiceJob]
    role: str
    echo: str | None
    prompt_tokens: int
    mode: WireMode | None
    totals: Totals = field(default_factory=Totals)
    """Usage so far (the server's metrics read it when the response ends)."""
    reasoning: ReasoningStrings | None = None
    """The delimiters that split the output into `reasoning` and `content` (a server with a
    reasoning parser), or None: all output is content."""
    reasoning_ended: bool = False
    """The prompt closed the thinking span (prompt_ends_reasoning): all output is content and
    `reasoning` is null."""
    content_entries_only: bool = False
    """Report entries only for tokens whose first text byte lies in a content source range
    (the Responses API's output text: reasoning, tool data, stripped whitespace, delimiters
    and tokens without text get none, as the contract asks)."""
    tool_use: ToolUse = field(default_factory=ToolUse)
    """What the request's tools make of the output (protocol/tools.py)."""

    @property
    def parsing(self) -> ParserSettings:
        use = self.tool_use
        parser = {"auto": use.parser, "none": None}.get(use.mode, use.mode)
        return ParserSettings(self.reasoning, self.reasoning_ended, parser, use.parallel,
                              use.name, use.parameters)


def _check_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat's own pairing rules, in vLLM's wording; the number of natural alternatives (None:
    no logprobs). Ranges and what the core serves are checked once, by the engine."""
    top = req.top_logprobs
    if top is not None and top < 0 and top != -1:
        raise RequestError("top_logprobs", "`top_logprobs` must be a positive value or -1.")
    if top is not None and (top > 0 or top == -1) and not req.logprobs:
        raise RequestError("top_logprobs",
                           "when using `top_logprobs`, `logprobs` must be set to true.")
    check_token_ids_given(req.logprob_token_ids)
    if req.logprob_token_ids is not None and not req.logprobs:
        raise RequestError("logprob_token_ids",
                           "when using `logprob_token_ids`, `logprobs` must be set to true.")
    return (top or 0) if req.logprobs else None


def _check_tool_usage(req: ChatCompletionRequest) -> None:
    """vLLM's check_tool_usage: what it refuses before tools are considered."""
    if req.tools == []:
        raise RequestError("tools", "`tools` must not be an empty array. Either provide at "
                                    "least one tool or omit the field entirely.")
    choice = req.tool_choice
    if choice is None or choice == "none":
        return
    if req.tools is None:
        raise RequestError("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise RequestError("tool_choice", f"Invalid value for `tool_choice`: {choice}! Only "
                                          'named tools, "none", "auto" or "required" are '
                                          "supported.")


def render(req: Any, messages: list[ChatMessage], assets: ModelAssets) -> str:
    """The conversation as text: `req` has add_generation_prompt, continue_final_message and
    chat_template_kwargs (a chat or a tokenize request); template errors name `messages`."""
    template = assets.chat_template
    if template is None:
        raise RequestError(
            "messages", "this model has no chat template (tokenizer_config.json chat_template)"
        )
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in RESERVED_TEMPLATE_KEYS and k != "continue_final_message"}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    tools = getattr(req, "tools", None)
    if tools:  # (vLLM passes them whatever the tool_choice)
        kwargs["tools"] = tools
    try:
        return template.render(
            [dict(message.fields) for message in messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **kwargs,
        )
    except ChatTemplateError as exc:
        raise RequestError("messages", str(exc)) from exc


def prepare_chat(
    req: ChatCompletionRequest, engine: EngineClient, assets: ModelAssets, *,
    content_entries_only: bool = False,
) -> PreparedChat:
    """Everything refused before admission raises RequestError here (HTTP 400). A server with a
    reasoning parser splits the output into reasoning and content (vLLM's `reasoning` field);
    `content_entries_only` then keeps the entries of content tokens only (Responses)."""
    _check_tool_usage(req)
    if req.tools is not None:
        check_tools(req.tools)
    tool_use = resolve_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls,
                                assets.tool_serving)
    defaults = assets.sampling_defaults
    check_request(req, defaults)
    messages = parse_messages(req.messages)
    top = _check_logprobs(req)
    stops = req.stop_strings()
    check_stops(stops)
    check_choices(req.n, 1)
    text = render(req, messages, assets)
    keep = truncation(req, engine.info.max_model_len)
    ids = assets.encode(text, add_special_tokens=req.add_special_tokens, param="messages",
                        max_model_len=engine.info.max_model_len if keep is None else None)
    ids = truncate(ids, keep, req.truncation_side)
    if not ids:
        raise RequestError("messages", "the rendered conversation has no tokens")
    info = engine.info
    param, requested = "max_tokens", req.max_tokens
    if req.max_completion_tokens is not None:
        param, requested = "max_completion_tokens", req.max_completion_tokens
    max_tokens = resolve_max_tokens(
        requested, len(ids), info.max_model_len, param, prompt_param="messages"
    )
    max_tokens = capped_max_tokens(max_tokens, defaults)
    jobs = []
    bad_words = bad_word_ids(req.bad_words, assets.word_ids)
    for i in range(req.n):
        params = build_params(
            req, defaults, max_tokens=max_tokens, logprobs=top,
            logprob_token_ids=req.logprob_token_ids if top is not None else None,
            seed=choice_seed(req.seed, i),
            prompt_logprobs=req.prompt_logprobs if i == 0 else None, bad_words=bad_words,
        )
        params = constrained(params, tool_use)
        if i == 0:
            info = engine.info
            check_logprob_request(
                params.logprobs, params.logprob_token_ids, info.vocab_size, info.max_logprobs,
                info.supports_token_ids, count_param="top_logprobs",
            )
        try:
            engine.check(ids, params)  # (every choice: a 400 before anything streams)
        except RequestError as exc:
            if exc.param != "prompt":
                raise
            raise RequestError("messages", exc.message) from exc
        jobs.append(ChoiceJob(i, ids, params, stops, req.include_stop_str_in_output,
                              req.skip_special_tokens))
    role = "assistant" if req.add_generation_prompt else messages[-1].role
    echo = None
    if req.echo and messages[-1].role == role:
        echo = messages[-1].content or ""
    reasoning = engine.info.reasoning
    strings = None if reasoning is None else reasoning.strings
    ended = reasoning is not None and prompt_ends_reasoning(ids, reasoning)
    totals = Totals(len(ids), reasoning=reasoning, reasoning_ended=ended)
    return PreparedChat(req, messages, jobs, role, echo, len(ids),
                        wire_mode(req, top is not None), totals, strings, ended,
                        content_entries_only, tool_use)


def _has_text(prep: PreparedChat, token_bytes: TokenBytes):
    """Whether a position's token shows text (a skipped special token or an empty piece has
    none, so no output-text entry)."""
    skip = prep.request.skip_special_tokens

    def has_text(position: Position) -> bool:
        token = position.token_id
        return bool(token_bytes.bytes_of(token)) and not (skip and token_bytes.is_special(token))

    return has_text


def choice_parser(prep: PreparedChat, token_bytes: TokenBytes) -> ParsedChoice | None:
    """A choice's parser, or None when its output is plain content reported whole."""
    settings = prep.parsing
    if not settings.active and not prep.content_entries_only:
        return None
    return ParsedChoice(settings, content_only=prep.content_entries_only,
                        has_text=_has_text(prep, token_bytes))


def _choice_body(prep: PreparedChat, text: str, positions: list[Position], finish: str | None,
                 token_bytes: TokenBytes) -> tuple[dict[str, Any], list[Position], str | None]:
    """A whole choice's message, the positions that get entries and the finish reason. With
    parsers, vLLM's split of the generated text: `reasoning` (left out with include_reasoning
    false; null when the prompt closed the thinking span), `content` (null when empty) and
    `tool_calls`; with content_entries_only, the content tokens' positions."""
    message: dict[str, Any] = {"role": prep.role, "content": text, "tool_calls": []}
    parsed = choice_parser(prep, token_bytes)
    if parsed is None:
        return message, positions, finish
    echo = prep.echo or ""
    events, kept = parsed.step(text[len(echo):], positions, final=True)
    reasoning, content, calls = texts(events)
    message["content"] = echo + content
    if prep.reasoning is not None or calls:
        message["content"] = message["content"] or None
    message["tool_calls"] = [tool_call_wire(call, index=False) for call in calls]
    if prep.reasoning is not None and prep.request.include_reasoning:
        message["reasoning"] = None if prep.reasoning_ended else reasoning
    return message, kept, finish_reason(finish, parsed.calls, prep.tool_use.mode)


def _logprobs(prep: PreparedChat, items: list[Position], assets: ModelAssets):
    if prep.mode is None:
        return None
    return chat_logprobs(items, assets.token_bytes, prep.mode)


async def chat(prep: PreparedChat, engine: EngineClient, assets: ModelAssets) -> dict:
    """The whole response; raises EngineError (or another error) after admission."""
    totals = prep.totals
    prefixes = dict.fromkeys(range(len(prep.jobs)), prep.echo or "")
    outcomes = await collect(prep.jobs, engine, assets, totals, prefixes)
    choices = []
    for out in outcomes:
        message, positions, finish = _choice_body(prep, out.text, out.positions,
                                                  out.finish_reason, assets.token_bytes)
        choices.append({
            "index": out.index,
            "message": message,
            "logprobs": _logprobs(prep, positions, assets),
            "finish_reason": finish,
            "stop_reason": out.stop_reason,
            **({"token_ids": out.token_ids} if prep.request.return_token_ids else {}),
        })
    ids = {"prompt_token_ids": list(prep.jobs[0].prompt_ids)} if (
        prep.request.return_token_ids) else {}
    return {
        **envelope("chatcmpl", "chat.completion", assets),
        **ids,
        "choices": choices,
        "usage": totals.usage(),
        "system_fingerprint": None,
        "prompt_logprobs": request_prompt_logprobs(prep.request, outcomes[0].prompt,
                                                   assets.token_bytes, prep.jobs[0].prompt_ids),
    }


def stream_chat(
    prep: PreparedChat, engine: EngineClient, assets: ModelAssets
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects (the caller encodes them as SSE, adds errors and [DONE])."""
    return_ids = bool(prep.request.return_token_ids)
    opening = []
    for index, job in enumerate(prep.jobs):
        # vLLM sends prompt_token_ids on a choice's first chunk: the role chunk.
        ids = {"prompt_token_ids": list(job.prompt_ids)} if return_ids else {}
        delta = {"role": prep.role, "content": ""}
        opening.append(({"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": None}, ids))
        if prep.echo:
            opening.append(({"index": index, "delta": {"content": prep.echo}, "logprobs": None,
                             "finish_reason": None}, {}))

    parsers = {index: choice_parser(prep, assets.token_bytes) for index in range(len(prep.jobs))}

    def choice(index: int, text: str, delta: Delta) -> dict[str, Any]:
        final = delta.finish_reason is not None
        parsed, positions, finish = parsers[index], delta.positions, delta.finish_reason
        if parsed is None:
            body: dict[str, Any] = {"content": text}
        else:
            events, positions = parsed.step(text, positions, final)
            body = delta_body(events, prep.request.include_reasoning)
            finish = finish_reason(finish, parsed.calls, prep.tool_use.mode)
        out = {
            "index": index,
            "delta": body,
            "logprobs": _logprobs(prep, positions, assets),
            "finish_reason": finish,
        }
        if prep.content_entries_only and parsed is not None:
            out[PARSED_KEY] = (events, positions)  # (the Responses API's, never sent)
        if delta.finish_reason is not None:
            out["stop_reason"] = delta.stop_reason
        if return_ids:
            out["token_ids"] = delta.token_ids
        return out

    def extra(index: int, delta: Delta) -> dict[str, Any]:
        if not delta.prompt:
            return {}
        scores = request_prompt_logprobs(prep.request, delta.prompt, assets.token_bytes,
                                         prep.jobs[index].prompt_ids)
        return {"prompt_logprobs": scores}

    return stream_chunks(
        prep.jobs, engine, assets, id_prefix="chatcmpl", obj="chat.completion.chunk",
        options=prep.request.stream_options, totals=prep.totals,
        prompt_tokens=dict.fromkeys(range(len(prep.jobs)), prep.prompt_tokens),
        choice=choice, opening=opening,
        extra=extra if prep.request.prompt_logprobs is not None else None,
    )
