"""Request models of the OpenAI-compatible API (field names and defaults as vLLM takes them).

Field policy (docs/api.md, "Request fields"):

* Unknown fields are accepted and ignored, as vLLM does; `ignored_fields` names them and the
  server logs one warning per request (logger "helios_logprobs.runtime.http").
* Known fields that would change the output if honoured but are not implemented are refused
  with HTTP 400 naming them when set to anything but their default: the `REFUSED` table,
  checked in its order by `refusal`.
* Known fields that cannot change the output (`IGNORED`: scheduling hints, ids, cache salts)
  are accepted and ignored without a warning.

The policy's tables are in refusals.py, chat messages are checked in messages.py. Responses
are plain dicts built in runtime/http/endpoints/ (completions.py, chat.py); their shapes are in
docs/api.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.http.protocol.refusals import (
    CHAT_REFUSED,
    COMMON_REFUSED,
    COMPLETION_REFUSED,
    REFUSED,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
MAX_CHOICES = 256
"""Upper bound on n times the number of prompts of one request (each is an engine request)."""

TokenId = StrictInt
"""A token id: a JSON integer. Booleans and floats (`false`, `1.0`) are refused, not coerced."""


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
"""OpenAI's reasoning effort values (chat `reasoning_effort`, Responses `reasoning.effort`)."""
EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)
SUMMARIES = ("auto", "concise", "detailed")
"""Responses `reasoning.summary` values (accepted; no summary is made)."""


class OpenAIModel(BaseModel):
    # Strict types, as OpenAI's API and the published schema have them: `"stream": "true"`,
    # `"background": 0` or `"temperature": "1"` are refused, not coerced (an int is still a
    # number).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

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
    """vLLM's current defaults: `{}` asks for nothing, and per-chunk usage needs include_usage."""

    include_usage: bool | None = False
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
    min_tokens: int = 0
    bad_words: list[str] | None = None
    """vLLM's: words whose tokens (with and without a leading space) cannot be completed."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """Keep this many prompt tokens (-1: the context length), vLLM's."""
    truncation_side: Literal["left", "right"] | None = None
    """"left" (the default) keeps the last truncate_prompt_tokens tokens, "right" the first."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    logprob_token_ids: list[TokenId] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    """vLLM's: the prompt's and the generated token ids alongside the text."""
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
    return_entropy: bool = False
    """SGLang's name: each generated position's entropy beside its logprob (needs logprobs)."""
    # Refused when set (REFUSED); typed where vLLM types them.
    use_beam_search: bool = False
    length_penalty: float | None = None
    best_of: int | None = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    spaces_between_special_tokens: bool = True
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

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None
    packed_top_logprobs: Any = None


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
    reasoning_effort: ReasoningEffort | None = None
    """Given to the chat template as `reasoning_effort` (templates that read it honour it)."""
    include_reasoning: bool = True
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses (OpenAI's Responses API, as vLLM takes it): text in, one assistant
    message out. Served through the chat path (runtime/http/endpoints/responses_api.py)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: Any = None
    truncation: str | None = None
    background: bool | None = None
    return_entropy: bool = False
    """SGLang's name, as on chat: each output_text logprob entry's entropy (needs the
    logprobs include or top_logprobs > 0)."""


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
    """vLLM's error response (its ErrorResponse, OpenAI's shape):
    {"error": {"message", "type", "param", "code"}}, `code` the HTTP status."""
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }.get(code, "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
