"""What clients of the engine see: parameters in, tokens with logprobs out (EngineClient; the
output types are in runtime/outputs.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, PromptScores
from helios_logprobs.runtime.structured.grammar import check_spec
from helios_logprobs.runtime.structured.spec import StructuredSpec
from helios_logprobs.runtime.text.reasoning import ReasoningTokens


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that cannot be completed (vLLM's bad_words, already tokenized)."""
    """EOS (unless ignored) and the stop token ids cannot be sampled before this many tokens,
    and stop strings are not matched before then (vLLM's min_tokens)."""
    logprobs: int | None = None
    """None: no logprobs. 0..K: the chosen token's logprob plus that many natural alternatives."""
    logprob_token_ids: tuple[int, ...] | None = None
    """Up to 128 distinct ids reported at every position in this order (no natural ones)."""
    prompt_logprobs: int | None = None
    """None: no prompt scoring. 0..20: every prompt position after the first is scored (its
    token's logprob and rank, plus that many natural alternatives); needs a scoring core."""
    thinking_token_budget: int | None = None
    """None: no budget. n >= 0: at most n tokens inside a thinking span (after the reasoning
    start string); then the reasoning end string's tokens are forced, one per position. Forced
    tokens are part of the text but have no logprob entry. Needs an engine with a reasoning
    configuration (reasoning_parser / reasoning_config)."""
    stop_token_entry: bool = False
    """A scoring request (Completions echo with logprobs): the terminating EOS or stop token
    is scored and reported with an entry (Finished.entry), as vLLM reports every generated
    token; its text stays out of the output as for any other request. Other requests: no
    entry."""
    speculative: bool = True
    """False opts this request out of speculative rounds (on an engine that runs them). Either
    way the tokens and logprobs are the same for greedy and seeded requests; speculation only
    changes how many tokens one step emits."""
    return_entropy: bool = False
    """SGLang's name: each generated position with a logprob also reports the entropy of the
    distribution it was reported from (GeneratedToken.entropy); needs logprobs."""
    structured: StructuredSpec | None = None
    """The output constraint (response_format, structured_outputs, a forced tool call):
    the sampler masks what the grammar forbids; reported logprobs stay the raw ones."""

    def __post_init__(self) -> None:
        # Everything else is checked once, by the engine's check (ranks.contract.requests and the
        # RowSampling / RequestSpec the ranks receive).
        if self.max_tokens < 0:
            raise RequestError("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise RequestError("structured_outputs", "expected a StructuredSpec")
            check_spec(self.structured, self.structured.source)  # (cached per spec)
            if self.thinking_token_budget is not None:
                raise RequestError(THINKING, "a thinking budget forces tokens the output "
                                             "constraint may not allow: not both")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.logprob_token_ids is not None

    @property
    def sampled_temperature(self) -> float:
        """The temperature the ranks sample with: vLLM's floor (``_MAX_TEMP`` in
        vllm/sampling_params.py) raises one in (0, 0.01) to 0.01, so only 0 is greedy."""
        t = self.temperature
        return MIN_TEMPERATURE if 0 < t < MIN_TEMPERATURE else t


THINKING = "thinking_token_budget"
MIN_TEMPERATURE = 0.01
"""The lowest positive temperature sampled with (vLLM's _MAX_TEMP)."""


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    """K: 0 when the core declares no logprob buffers."""
    supports_token_ids: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    prompt_logprobs: bool = False
    """Whether the core scores prompts (--prompt-logprobs)."""
    reasoning: ReasoningTokens | None = None
    """The reasoning delimiters' token ids; None: thinking_token_budget is refused."""

    @property
    def allow_logprobs(self) -> bool:
        return self.max_logprobs > 0


class EngineClient(Protocol):
    """The engine as the HTTP server and the offline generator see it."""

    info: EngineInfo

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError naming the parameter for anything refused before admission."""

    def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[PromptScores | GeneratedToken | Finished]:
        """Yields the prompt's scores (when asked for), then tokens in generated order, then
        exactly one Finished; raises EngineError."""

    def healthy(self) -> bool: ...
