"""The request of POST /inference/v1/generate: vLLM's GenerateRequest with its
SamplingParams (runtime/http/endpoints/generate.py serves it)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from helios_logprobs.runtime.http.protocol.models import (
    INT64_MAX,
    INT64_MIN,
    OpenAIModel,
    StreamOptions,
    TokenId,
)

SP = "sampling_params"
REFUSED = {  # set to anything but these, they would change the output: 400 naming them
    "stop": (None, [], ""), "structured_outputs": (None,), "guided_decoding": (None,),
    "logits_processors": (None, []), "truncate_prompt_tokens": (None,),
    "best_of": (None, 1), "use_beam_search": (None, False),
}


class GenerateSampling(OpenAIModel):
    """vLLM's SamplingParams as /inference/v1/generate takes them (its defaults: neutral
    sampling, not the model's generation_config)."""

    n: int = Field(1, ge=1)
    max_tokens: int | None = None
    """None: the room the context leaves (vLLM's server-side default)."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    thinking_token_budget: int | None = None
    return_entropy: bool = False
    """SGLang's name: each entry's entropy (needs logprobs)."""
    # Accepted; nothing is detokenized here whatever they say.
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Refused when set (REFUSED).
    stop: str | list[str] | None = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None


class GenerateRequest(OpenAIModel):
    """vLLM's GenerateRequest."""

    REFUSED_FIELDS: ClassVar[tuple[str, ...]] = ()

    token_ids: list[TokenId]
    sampling_params: GenerateSampling
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    features: Any = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: Any = None

    @property
    def prompt_logprobs(self) -> int | None:
        return self.sampling_params.prompt_logprobs
