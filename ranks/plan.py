"""Step plans: what the coordinator sends every rank before each submission."""

from __future__ import annotations

from dataclasses import dataclass

from helios_logprobs.collectives.codec import message, register
from helios_logprobs.kernels.layout import MAX_TOKEN_IDS
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.ranks.sampler.params import RowSampling

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
    """Token ids that end the request (EOS unless ignore_eos, stop ids): without an entry,
    unless ``stop_entry``."""
    wants_logprobs: bool = False
    """The request reports logprobs: its lane is flagged in every sampling submission."""
    logprob_token_ids: tuple[int, ...] = ()
    wants_entropy: bool = False
    """Each sampled position also reports its distribution's entropy (needs the logprob
    flag: the reduction computes it for flagged lanes; StepPlan.entropy)."""
    scores_prompt: bool = False
    """The prompt is prefilled with scored_prefill chunks (SlotWork.targets)."""
    thinking_budget: int | None = None
    """Tokens allowed inside a thinking span before the commit forces ``think_end``."""
    think_start: tuple[int, ...] = ()
    """The reasoning start string's token ids (opens a thinking span)."""
    think_end: tuple[int, ...] = ()
    """The reasoning end string's token ids, forced one per position once the budget is
    spent."""
    stop_entry: bool = False
    """A scoring request (Completions echo with logprobs): the terminating stop token is
    emitted as the record's last position, so the reduction scores it like any sampled token
    (vLLM reports every generated token); the request ends with it all the same."""

    def __post_init__(self) -> None:
        if self.thinking_budget is not None:
            if self.thinking_budget < 0:
                raise RequestError("thinking_token_budget",
                                   f"must be >= 0, got {self.thinking_budget}")
            if not self.think_start or not self.think_end:
                raise RequestError("thinking_token_budget",
                                   "needs the reasoning start and end token ids")
        if self.max_tokens < (0 if self.scores_prompt else 1):
            raise RequestError("max_tokens", f"must be >= 1 when sampling, got {self.max_tokens}")
        if len(self.logprob_token_ids) > MAX_TOKEN_IDS:
            raise RequestError("logprob_token_ids", f"at most {MAX_TOKEN_IDS} ids")
        if self.logprob_token_ids and not self.wants_logprobs:
            raise RequestError("logprob_token_ids", "requires the logprob flag")
        if self.wants_entropy and not self.wants_logprobs:
            raise RequestError("return_entropy", "requires the logprob flag")
        if self.stop_entry and not self.wants_logprobs:
            raise RequestError("logprobs", "a scored stop token requires the logprob flag")


@message("ranks.slot_work")
@dataclass(frozen=True)
class SlotWork:
    """One slot's part of a submission: a prefill chunk, one decode token, or a speculative
    round: ``tokens`` = (last token, p1..pN) at consecutive positions, ``proposals`` =
    (p1..pN). A round samples one row per token (the rows are contiguous in the logits):
    row i is the target's token at generated position len(output) + i, and proposal i+1 is
    accepted exactly when it equals row i's token (ranks/speculative.py)."""

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
    proposals: tuple[int, ...] = ()
    """A speculative round's proposed tokens (tokens[1:]); empty for every other item."""
    grammar_masks: tuple[bytes, ...] = ()
    """A constrained request's sampling rows: one grammar bitmask row each (1 + proposals;
    ranks/grammar_mask.py), computed on the coordinator; empty: unconstrained."""

    def __post_init__(self) -> None:
        if self.grammar_masks and (not self.samples
                                   or len(self.grammar_masks) != 1 + len(self.proposals)):
            raise ValueError(
                f"slot {self.slot}: {len(self.grammar_masks)} grammar masks for "
                f"{1 + len(self.proposals) if self.samples else 0} sampling rows"
            )
        if not self.tokens:
            raise ValueError(f"slot {self.slot}: a work item needs at least one token")
        if self.proposals and (
            not self.samples or self.targets or self.request is not None
            or self.tokens[1:] != self.proposals
        ):
            raise ValueError(
                f"slot {self.slot}: a speculative round feeds (last token, *proposals) of a "
                f"running request and samples every row"
            )
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
    entropy: bool = False
    """A sampling lane of this submission asks for entropy: the reduction also writes each
    gated position's entropy (StepReduction.entropy_frames); False: it computes none."""

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

    @property
    def sampling_rows(self) -> int:
        """Logit rows the submission samples: one per sampling item, plus one per proposal."""
        return sum(1 + len(w.proposals) for w in self.work if w.samples)
