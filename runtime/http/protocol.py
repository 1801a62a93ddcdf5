"""Request models of the OpenAI-compatible API (field names and defaults as vLLM takes them).

Field policy (docs/api.md, "Request fields"):

* Unknown fields are accepted and ignored, as vLLM does; `ignored_fields` names them and the
  server logs one warning per request (logger "runtime.http").
* Known fields that would change the output if honoured but are not implemented are refused
  with HTTP 400 naming them when set to anything but their default: the `REFUSED` table,
  checked in its order by `refusal`.
* Known fields that cannot change the output (`IGNORED`: scheduling hints, ids, cache salts)
  are accepted and ignored without a warning.

Chat messages are kept as given (extra keys reach the chat template) and checked by
`parse_messages`, which names the offending message and key. Responses are plain dicts built
in runtime/http/completions.py and runtime/http/chat.py; their shapes are in docs/api.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ranks.contract.requests import RequestError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
MAX_CHOICES = 256
"""Upper bound on n times the number of prompts of one request (each is an engine request)."""

TokenId = StrictInt
"""A token id: a JSON integer. Booleans and floats (`false`, `1.0`) are refused, not coerced."""


# ----------------------------------------------------------------------------- field policy
def _given(value: Any, req: Any) -> bool:
    return value is not None


def _truthy(value: Any, req: Any) -> bool:
    return bool(value)


def _false(value: Any, req: Any) -> bool:
    return value is False


def _not_one(value: Any, req: Any) -> bool:
    return value is not None and value != 1.0


def _best_of(value: Any, req: Any) -> bool:
    return value is not None and value != req.n


def _not_text_format(value: Any, req: Any) -> bool:
    if value is None:
        return False
    return not (isinstance(value, dict) and value.get("type", "text") == "text")


def _forces_calls(value: Any, req: Any) -> bool:
    return value not in (None, "none", "auto")


def _not_text_only(value: Any, req: Any) -> bool:
    return value is not None and value != ["text"]


@dataclass(frozen=True)
class Refusal:
    """A field refused with 400 when `is_set(value, request)` (i.e. not its default)."""

    why: str
    is_set: Callable[[Any, Any], bool] = _given


STRUCTURED = "structured outputs are not supported by this server"
TOOLS = "tool calling is not supported by this server"
REASONING = "reasoning controls are not supported by this server (no reasoning parser)"

REFUSED: dict[str, Refusal] = {
    # sampling and decoding features that are not implemented
    "use_beam_search": Refusal("beam search is not supported by this server", _truthy),
    "length_penalty": Refusal("length_penalty applies to beam search, which is not supported",
                              _not_one),
    "best_of": Refusal("best_of other than n is not supported by this server", _best_of),
    "min_tokens": Refusal("min_tokens is not supported by this server", _truthy),
    "bad_words": Refusal("bad_words is not supported by this server", _truthy),
    "logits_processors": Refusal("custom logits processors are not supported", _truthy),
    "vllm_xargs": Refusal("vllm_xargs (custom processor arguments) is not supported"),
    "repetition_detection": Refusal("repetition_detection is not supported by this server"),
    "watermarking": Refusal("watermarking is not supported by this server", _truthy),
    "spaces_between_special_tokens": Refusal("only the default (true) is supported", _false),
    "return_token_ids": Refusal("return_token_ids is not supported by this server", _truthy),
    # prompt handling
    "prompt_embeds": Refusal("prompt_embeds is not supported by this server"),
    "truncate_prompt_tokens": Refusal("truncate_prompt_tokens is not supported by this server"),
    "truncation_side": Refusal("truncation_side is not supported (no prompt truncation)"),
    "suffix": Refusal("suffix is not supported by this server", _truthy),
    "kv_transfer_params": Refusal("kv_transfer_params (disaggregated serving) is not supported"),
    # structured outputs
    "response_format": Refusal("only response_format type 'text' is supported",
                               _not_text_format),
    "structured_outputs": Refusal(STRUCTURED),
    "guided_json": Refusal(STRUCTURED),
    "guided_regex": Refusal(STRUCTURED),
    "guided_choice": Refusal(STRUCTURED),
    "guided_grammar": Refusal(STRUCTURED),
    "guided_decoding_backend": Refusal(STRUCTURED),
    "guided_whitespace_pattern": Refusal(STRUCTURED),
    # chat: tools, reasoning, template inputs, other modalities
    "tools": Refusal(TOOLS, _truthy),
    "tool_choice": Refusal(TOOLS + " (tool_choice may only be 'none' or 'auto')", _forces_calls),
    "functions": Refusal(TOOLS, _truthy),
    "function_call": Refusal(TOOLS + " (function_call may only be 'none' or 'auto')",
                             _forces_calls),
    "reasoning_effort": Refusal(REASONING),
    "include_reasoning": Refusal(REASONING + "; include_reasoning may only be true", _false),
    "chat_template": Refusal("a request-supplied chat_template is not supported"),
    "documents": Refusal("documents are not supported by this server"),
    "mm_processor_kwargs": Refusal("multimodal inputs are not supported by this server"),
    "modalities": Refusal("only the text modality is supported", _not_text_only),
    "audio": Refusal("audio output is not supported by this server"),
    "web_search_options": Refusal("web search is not supported by this server"),
}
"""Every field refused when set, in checking order. A request model declares the ones that
vLLM takes on its endpoint (`REFUSED_FIELDS`); elsewhere they are unknown fields."""

COMMON_REFUSED = (
    "use_beam_search", "length_penalty", "best_of", "min_tokens", "bad_words",
    "logits_processors", "vllm_xargs", "repetition_detection",
    "watermarking", "spaces_between_special_tokens", "return_token_ids",
    "truncate_prompt_tokens", "truncation_side", "kv_transfer_params", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)
COMPLETION_REFUSED = (*COMMON_REFUSED, "suffix", "prompt_embeds")
CHAT_REFUSED = (
    *COMMON_REFUSED, "tools", "tool_choice", "functions", "function_call", "reasoning_effort",
    "include_reasoning", "chat_template", "documents", "mm_processor_kwargs", "modalities",
    "audio", "web_search_options",
)

IGNORED = ("user", "priority", "request_id", "cache_salt", "session_id", "stream_interval",
           "parallel_tool_calls")
"""Known fields accepted and ignored without a warning: they cannot change the output here
(`parallel_tool_calls` only matters with `tools`, which are refused)."""

MAX_LOGGED_FIELDS = 32
MAX_LOGGED_NAME = 64


def ignored_fields_message(names: list[str]) -> str:
    """vLLM's log line for unknown fields (bounded: names come from the client)."""
    shown = [repr(n if len(n) <= MAX_LOGGED_NAME else n[:MAX_LOGGED_NAME] + "...")
             for n in sorted(names)[:MAX_LOGGED_FIELDS]]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return ("The following fields were present in the request but ignored: "
            f"{{{', '.join(shown)}}}{more}")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = ()

    def refusal(self) -> RequestError | None:
        """The first field set that this server cannot honour (REFUSED order), else None."""
        for name in REFUSED:
            if name in self.REFUSED_FIELDS and REFUSED[name].is_set(getattr(self, name), self):
                return RequestError(name, f"{name}: {REFUSED[name].why}")
        return None

    def ignored_fields(self) -> list[str]:
        """Unknown fields, nested ones as `outer.inner` (accepted and ignored, as vLLM does)."""
        names = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, OpenAIModel):
                names += [f"{name}.{inner}" for inner in value.ignored_fields()]
        return names


class StreamOptions(OpenAIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = COMMON_REFUSED

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    logprob_token_ids: list[TokenId] | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
    """0..20 on a server started with --prompt-logprobs (the engine checks it)."""
    # Accepted and ignored (IGNORED).
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    session_id: Any = None
    stream_interval: int | None = None
    thinking_token_budget: int | None = None
    """vLLM's sampling parameter: once this many tokens are inside a thinking span, the end
    string is forced (needs --reasoning-parser or --reasoning-config)."""
    speculative: bool = True
    """False opts this request out of history proposals (--speculative-tokens)."""
    # Refused when set (REFUSED); typed where vLLM types them.
    use_beam_search: bool = False
    length_penalty: float | None = None
    best_of: int | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Any = None
    kv_transfer_params: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = COMPLETION_REFUSED

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None


@dataclass(frozen=True)
class ChatMessage:
    """One checked message: `fields` is what the template sees (the message's own non-null
    keys, `content` as text); `content` is None only for an assistant message with tool calls
    (its `fields` then have no `content`)."""

    role: str
    content: str | None
    fields: dict[str, Any]


def _message_error(where: str, message: str) -> RequestError:
    return RequestError("messages", f"{where}: {message}")


def _content_text(content: Any, where: str) -> str:
    """A string, or text parts joined with newlines (vLLM's rule); any other part is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _message_error(
            where, f"must be a string or a list of content parts, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _message_error(at, "a content part must be an object")
        kind = part.get("type")
        if kind is None:
            raise _message_error(f"{at}.type", "a content part needs a type")
        if kind != "text":
            raise _message_error(f"{at}.type", f"Unsupported chat content part type: {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise _message_error(f"{at}.text", "a text part needs a string text")
        texts.append(text)
    return "\n".join(texts)


def _calls_tools(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return (isinstance(calls, list) and bool(calls)) or message.get("function_call") is not None


def parse_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """Checked messages; RequestError (param "messages", the message naming the key) for a
    missing or non-string role, missing or null content (allowed only for an assistant
    message with tool_calls), content of another type, or a content part other than text."""
    if not messages:
        raise RequestError("messages", "messages must contain at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role is None:
            raise _message_error(f"{where}.role", "every message needs a role")
        if not isinstance(role, str) or not role:
            raise _message_error(f"{where}.role", "the role must be a non-empty string")
        content = message.get("content")
        if content is None:
            if role != "assistant" or not _calls_tools(message):
                state = "null" if "content" in message else "missing"
                raise _message_error(
                    f"{where}.content",
                    f"content is {state}; only an assistant message with tool_calls may omit it",
                )
            text = None
        else:
            text = _content_text(content, f"{where}.content")
        # Keys whose value is null are dropped, as transformers' apply_chat_template does
        # (a template then sees an assistant tool-call message without `content`).
        fields = {k: v for k, v in message.items() if v is not None}
        if text is not None:
            fields["content"] = text
        out.append(ChatMessage(role, text, fields))
    return out


class ChatCompletionRequest(SamplingFields):
    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = CHAT_REFUSED

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    include_reasoning: bool = True
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None


TOKENIZE_CHAT_REFUSED = ("tools", "chat_template", "mm_processor_kwargs")


class TokenizeCompletionRequest(OpenAIModel):
    """POST /tokenize with a prompt (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIModel):
    """POST /tokenize with messages (vLLM's TokenizeChatRequest), rendered as chat does."""

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = TOKENIZE_CHAT_REFUSED

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's DetokenizeRequest)."""

    model: str | None = None
    tokens: list[TokenId]


def error_body(message: str, param: str | None, code: int = 400) -> dict[str, Any]:
    """vLLM's error response: {"object": "error", "message", "type", "param", "code"}."""
    kind = {
        400: "BadRequestError",
        404: "NotFoundError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }.get(code, "Error")
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}
