"""Step plans: what the coordinator sends every rank before each submission."""

from __future__ import annotations

from dataclasses import dataclass

from collectives.codec import message, register
from kernels.layout import MAX_TOKEN_IDS
from ranks.requests import RequestError
from ranks.sampling_params import RowSampling

register(RowSampling, "ranks.row_sampling")


@message("ranks.request_spec")
@dataclass(frozen=True)
class RequestSpec:
    """Sent once, with a request's first chunk; ranks keep it for the slot's epoch."""

    ordinal: int
    max_tokens: int
    sampling: RowSampling
    """Sampler parameters with the request's seed; ranks set the position per step."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request without an entry (EOS unless ignore_eos, stop ids)."""
    logprobs: bool = False
    logprob_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    """The prompt is prefilled with scored_prefill chunks (SlotWork.targets)."""

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs else 1):
            raise RequestError("max_tokens", f"must be >= 1 when sampling, got {self.max_tokens}")
        if len(self.logprob_token_ids) > MAX_TOKEN_IDS:
            raise RequestError("logprob_token_ids", f"at most {MAX_TOKEN_IDS} ids")
        if self.logprob_token_ids and not self.logprobs:
            raise RequestError("logprob_token_ids", "requires the logprob flag")


@message("ranks.slot_work")
@dataclass(frozen=True)
class SlotWork:
    """One slot's part of a submission: a prefill chunk or one decode token."""

    slot: int
    epoch: int
    tokens: tuple[int, ...]
    start: int
    """Position of tokens[0] in the slot's sequence."""
    samples: bool
    """The last token's logits are sampled (final prefill chunk, or decode)."""
    request: RequestSpec | None = None
    """Present on a request's first chunk: the slot gets a new epoch and history."""
    targets: tuple[int, ...] = ()
    """A scored_prefill chunk: targets[j] is the prompt token after tokens[j], or -1 at the
    prompt end. Empty for every other work item."""

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(f"slot {self.slot}: a work item needs at least one token")
        if self.targets and len(self.targets) != len(self.tokens):
            raise ValueError(
                f"slot {self.slot}: {len(self.targets)} targets for {len(self.tokens)} tokens"
            )
        if self.start < 0:
            raise ValueError(f"slot {self.slot}: negative start position {self.start}")


@message("ranks.step_plan")
@dataclass(frozen=True)
class StepPlan:
    submission: int
    work: tuple[SlotWork, ...]

    def __post_init__(self) -> None:
        slots = [w.slot for w in self.work]
        if len(set(slots)) != len(slots):
            raise ValueError(f"submission {self.submission}: a slot appears twice")
        if sum(1 for w in self.work if w.targets) > 1:
            raise ValueError(f"submission {self.submission}: more than one scored chunk")

    @property
    def scored(self) -> SlotWork | None:
        """The submission's scored_prefill chunk (at most one per submission)."""
        return next((w for w in self.work if w.targets), None)

    @property
    def frame(self) -> int:
        return self.submission % 2
