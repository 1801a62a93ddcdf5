"""Request models of the OpenAI-compatible API (field names and defaults as vLLM takes them).

Unknown fields are ignored (as vLLM does). Known fields that this runtime cannot honour are
refused with HTTP 400 naming them (see `unsupported`). Responses are plain dicts built in
runtime/http/completions.py and runtime/http/chat.py; their shapes are in docs/api.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
MAX_CHOICES = 256
"""Upper bound on n times the number of prompts of one request (each is an engine request)."""


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    user: str | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None
    # Known but not supported here: refused with 400 when set to a non-default value.
    min_tokens: int = 0
    use_beam_search: bool = False
    best_of: int | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    response_format: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first known field this runtime cannot honour."""
        if self.min_tokens:
            return "min_tokens", "min_tokens is not supported by this server"
        if self.use_beam_search:
            return "use_beam_search", "beam search is not supported by this server"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported by this server"
        if self.bad_words:
            return "bad_words", "bad_words is not supported by this server"
        if self.prompt_logprobs is not None:
            return (
                "prompt_logprobs",
                "prompt logprobs are not supported: this core has no prompt scoring buffers",
            )
        if self.truncate_prompt_tokens is not None:
            return "truncate_prompt_tokens", "truncate_prompt_tokens is not supported"
        if not self.spaces_between_special_tokens:
            return "spaces_between_special_tokens", "only the default (true) is supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format type 'text' is supported"
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def chat_unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported by this server"
        return self.unsupported()


def error_body(message: str, param: str | None, code: int = 400) -> dict[str, Any]:
    """vLLM's error response: {"object": "error", "message", "type", "param", "code"}."""
    kind = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }.get(code, "Error")
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}
