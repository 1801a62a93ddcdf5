"""Field policy (docs/api.md, "Request fields"): known fields that would change the output if
honoured but are not implemented are refused with HTTP 400 naming them when set to anything
but their default (the `REFUSED` table, checked in its order); known fields that cannot change
the output (`IGNORED`) are accepted silently; unknown fields are accepted and logged once per
request (`ignored_fields_message`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def _forces_calls(value: Any, req: Any) -> bool:
    return value not in (None, "none", "auto")


def _not_text_only(value: Any, req: Any) -> bool:
    return value is not None and value != ["text"]


@dataclass(frozen=True)
class Refusal:
    """A field refused with 400 when `is_set(value, request)` (i.e. not its default)."""

    why: str
    is_set: Callable[[Any, Any], bool] = _given


STRUCTURED = ("vLLM's older guided_* fields are not taken (current vLLM ignores them): use "
              "structured_outputs or response_format")
TOOLS = "the deprecated functions API is not supported by this server (use tools)"
REFUSED: dict[str, Refusal] = {
    # sampling and decoding features that are not implemented
    "use_beam_search": Refusal("beam search is not supported by this server", _truthy),
    "length_penalty": Refusal("length_penalty applies to beam search, which is not supported",
                              _not_one),
    "best_of": Refusal("best_of other than n is not supported by this server", _best_of),
    "logits_processors": Refusal("custom logits processors are not supported", _truthy),
    "vllm_xargs": Refusal("vllm_xargs (custom processor arguments) is not supported"),
    "repetition_detection": Refusal("repetition_detection is not supported by this server"),
    "watermarking": Refusal("watermarking is not supported by this server", _truthy),
    "spaces_between_special_tokens": Refusal("only the default (true) is supported", _false),
    # prompt handling
    "prompt_embeds": Refusal("prompt_embeds is not supported by this server", _truthy),
    "suffix": Refusal("suffix is not supported by this server", _truthy),
    "kv_transfer_params": Refusal("kv_transfer_params (disaggregated serving) is not supported"),
    # output layouts
    "packed_top_logprobs": Refusal("packed_top_logprobs (base64-packed top logprobs) is not "
                                   "supported by this server", _truthy),
    # structured outputs
    "guided_json": Refusal(STRUCTURED),
    "guided_regex": Refusal(STRUCTURED),
    "guided_choice": Refusal(STRUCTURED),
    "guided_grammar": Refusal(STRUCTURED),
    "guided_decoding_backend": Refusal(STRUCTURED),
    "guided_whitespace_pattern": Refusal(STRUCTURED),
    # chat: tools, reasoning, template inputs, other modalities
    "functions": Refusal(TOOLS, _truthy),
    "function_call": Refusal(TOOLS + " (function_call may only be 'none' or 'auto')",
                             _forces_calls),
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
    "use_beam_search", "length_penalty", "best_of",
    "logits_processors", "vllm_xargs", "repetition_detection",
    "watermarking", "spaces_between_special_tokens",
    "kv_transfer_params", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)
COMPLETION_REFUSED = (*COMMON_REFUSED, "suffix", "prompt_embeds", "packed_top_logprobs")
CHAT_REFUSED = (
    *COMMON_REFUSED, "functions", "function_call",
    "chat_template", "documents", "mm_processor_kwargs", "modalities",
    "audio", "web_search_options",
)

IGNORED = ("user", "priority", "request_id", "cache_salt", "session_id", "stream_interval",
           "parallel_tool_calls")
"""Known fields accepted without a warning that cannot change the output here
(`parallel_tool_calls` changes it only with `tools`: protocol/tools.py)."""

MAX_LOGGED_FIELDS = 32
MAX_LOGGED_NAME = 64


def ignored_fields_message(names: list[str]) -> str:
    """vLLM's log line for unknown fields (bounded: names come from the client)."""
    shown = [repr(n if len(n) <= MAX_LOGGED_NAME else n[:MAX_LOGGED_NAME] + "...")
             for n in sorted(names)[:MAX_LOGGED_FIELDS]]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return ("The following fields were present in the request but ignored: "
            f"{{{', '.join(shown)}}}{more}")
