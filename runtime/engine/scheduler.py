"""Admission, slots, epochs, chunked prefill and speculative rounds: turns waiting requests
into step plans."""

from __future__ import annotations

import logging
import random
import secrets
from collections import deque
from dataclasses import dataclass, field

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.ranks.plan import RequestSpec, SlotWork, StepPlan
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.client import MIN_TEMPERATURE, EngineInfo, SamplingParams
from helios_logprobs.runtime.engine.decoding.lanes import LaneExpectation
from helios_logprobs.runtime.engine.proposer import HistoryProposer
from helios_logprobs.runtime.outputs import EngineError
from helios_logprobs.runtime.structured.backend import GrammarError, LazyGrammarBackend
from helios_logprobs.runtime.structured.state import GrammarState, GrammarViolation
from helios_logprobs.runtime.text.reasoning import ReasoningTokens

log = logging.getLogger("helios_logprobs.runtime.engine")

THINKING_BUDGET = "thinking_token_budget"


@dataclass(frozen=True)
class SchedulerConfig:
    capacity: int
    max_seq_len: int
    chunk_size: int = 256
    max_batched_tokens: int = 1024
    speculative_tokens: int = 0
    """N: history proposals per decode (0: no speculative rounds)."""
    ngram_min: int = 2
    ngram_max: int = 4
    reasoning: ReasoningTokens | None = None
    """The reasoning delimiters' ids (thinking_token_budget needs them); None: refused."""
    seed: int | None = None
    """--seed: where the seeds of requests without one come from (see unset_seed)."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.chunk_size < 1 or self.max_batched_tokens < 1:
            raise ValueError("capacity, chunk_size and max_batched_tokens must be >= 1")
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")


@dataclass
class Request:
    ordinal: int
    prompt: list[int]
    params: SamplingParams
    spec: RequestSpec
    sink: object
    """Receives this request's events (see runtime.engine.engine)."""
    slot: int = -1
    epoch: int = 0
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    done: bool = False
    proposals: tuple[int, ...] = ()
    """The proposals of the request's round in the last plan (empty: an ordinary decode)."""
    lane: LaneExpectation | None = None
    """What the decoder expects of its records (frame_reader builds it once per epoch)."""
    grammar: GrammarState | None = None
    """The matcher of a constrained request (params.structured), made when it is added."""

    @property
    def wants_logprobs(self) -> bool:
        return self.spec.wants_logprobs


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.epochs = [0] * config.capacity
        self.submission = 0
        self.grammars: LazyGrammarBackend | None = None
        """The structured-output backend (set by the engine's builder); None: constrained
        requests fail with an error event."""
        self.proposer = None
        if config.speculative_tokens:
            self.proposer = HistoryProposer(config.speculative_tokens, config.ngram_min,
                                            config.ngram_max)

    def add(self, request: Request) -> None:
        spec = request.params.structured
        if spec is not None and request.grammar is None:
            try:
                if self.grammars is None:
                    raise GrammarError("this engine has no structured-output backend")
                request.grammar = self.grammars.state(spec)
            except GrammarError as exc:
                request.done = True
                request.sink.put(EngineError(f"{spec.source}: {exc}"))
                return
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        request.done = True
        if self.proposer is not None:
            self.proposer.release(request.ordinal)
        if self.running.get(request.slot) is request:
            del self.running[request.slot]
        elif request in self.waiting:
            self.waiting.remove(request)

    def _admit(self) -> list[Request]:
        admitted = []
        free = [s for s in range(self.config.capacity) if s not in self.running]
        while self.waiting and free:
            request = self.waiting.popleft()
            if request.done:
                continue
            slot = free.pop(0)
            self.epochs[slot] += 1
            request.slot, request.epoch = slot, self.epochs[slot]
            self.running[slot] = request
            admitted.append(request)
        return admitted

    def next_plan(self) -> tuple[StepPlan, list[Request]] | None:
        """The next submission and the requests it carries, or None when idle."""
        self._admit()
        budget = self.config.max_batched_tokens
        work, carried = [], []
        decodes = [r for r in self.running.values() if r.prefilled == len(r.prompt)]
        prefills = [r for r in self.running.values() if r.prefilled < len(r.prompt)]
        for request in decodes:
            if budget < 1:
                break
            position = len(request.prompt) + len(request.generated) - 1
            proposals = self._propose(request, position, budget - 1)
            proposals, masks = self._constrain(request, proposals)
            if request.done:
                continue
            request.proposals = proposals
            work.append(SlotWork(request.slot, request.epoch, (request.generated[-1], *proposals),
                                 position, samples=True, proposals=proposals,
                                 grammar_masks=masks))
            carried.append(request)
            budget -= 1 + len(proposals)
        scored = False
        for request in prefills:
            take = min(self.config.chunk_size, budget, len(request.prompt) - request.prefilled)
            if take < 1:
                break
            if request.spec.scores_prompt and scored:
                continue  # one scored chunk per submission: it waits for the next one
            start = request.prefilled
            chunk = tuple(request.prompt[start : start + take])
            last = start + take == len(request.prompt)
            first = start == 0
            targets = (scored_targets(request.prompt, start, take)
                       if request.spec.scores_prompt else ())
            scored = scored or bool(targets)
            samples = last and request.spec.max_tokens > 0
            masks = self._constrain(request, ())[1] if samples else ()
            if request.done:
                continue
            work.append(SlotWork(request.slot, request.epoch, chunk, start, samples=samples,
                                 request=request.spec if first else None, targets=targets,
                                 grammar_masks=masks))
            request.prefilled += take
            carried.append(request)
            budget -= take
        if not work:
            return None
        entropy = any(r.spec.wants_entropy for r, w in zip(carried, work, strict=True)
                      if w.samples)
        plan = StepPlan(self.submission, tuple(work), entropy=entropy)
        self.submission += 1
        return plan, carried


    def _constrain(self, request: Request, proposals: tuple[int, ...]
                   ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """(the proposals the grammar keeps, the bitmask row of each sampling row) of a
        constrained request's next sample; an unconstrained one's proposals and no masks. A
        committed token the grammar rejects ends the request with an error event."""
        if request.grammar is None:
            return proposals, ()
        try:
            return request.grammar.round(request.generated, proposals)
        except GrammarViolation as exc:
            self.finish(request)
            request.sink.put(EngineError(f"structured output: {exc}"))
            return (), ()

    def _propose(self, request: Request, position: int, budget: int) -> tuple[int, ...]:
        """History proposals for a decode whose last token sits at ``position``: at most N,
        the submission's remaining token budget, and the positions left below max_seq_len
        (as vLLM, not clipped at max_tokens: the commit clips the emitted run)."""
        if self.proposer is None or not request.params.speculative:
            return ()
        limit = min(budget, self.config.max_seq_len - 1 - position)
        return self.proposer.propose(request.ordinal, request.prompt, request.generated, limit)


def scored_targets(prompt: list[int], start: int, take: int) -> tuple[int, ...]:
    """A scored chunk's targets: row j predicts prompt[start + j + 1]; -1 at the prompt end."""
    targets = prompt[start + 1 : start + take + 1]
    return (*targets, *([-1] * (take - len(targets))))


def check_thinking_budget(budget: object, reasoning: ReasoningTokens | None) -> None:
    """thinking_token_budget: None, or an integer >= 0 on an engine with reasoning
    delimiters."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise RequestError(THINKING_BUDGET, f"must be an integer >= 0, got {budget!r}")
    if reasoning is None:
        raise RequestError(
            THINKING_BUDGET,
            "needs a server started with a reasoning configuration (--reasoning-parser or "
            "--reasoning-config): this one has no thinking delimiters",
        )


def unset_seed(server_seed: int | None, ordinal: int) -> int:
    """The seed of the ``ordinal``-th request, which set none: a fresh draw, or with a server
    seed (vLLM's --seed) a function of both, so the same requests in the same order sample
    the same tokens in every run."""
    if server_seed is None:
        return secrets.randbits(63)
    return random.Random(f"{server_seed}/{ordinal}").getrandbits(63)


def request_spec(
    info: EngineInfo,
    ordinal: int,
    prompt_ids: list[int],
    params: SamplingParams,
    reasoning: ReasoningTokens | None = None,
    server_seed: int | None = None,
) -> RequestSpec:
    """What the ranks need to know about a request; the seed is drawn here when unset."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(info.eos_token_ids)
    room = info.max_model_len - len(prompt_ids)
    if params.temperature != params.sampled_temperature:
        log.warning("temperature %s is less than %s, which may cause numerical errors nan or "
                    "inf in tensors. We have maxed it out to %s.", params.temperature,
                    MIN_TEMPERATURE, MIN_TEMPERATURE)  # (vLLM's words)
    sampling = RowSampling(
        seed=params.seed if params.seed is not None else unset_seed(server_seed, ordinal),
        position=0,
        temperature=params.sampled_temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        min_tokens=params.min_tokens,
        min_tokens_ids=tuple(sorted(stops)) if params.min_tokens else (),
        bad_words=params.bad_words,
    )
    scored = params.prompt_logprobs is not None
    thinking = {}
    if params.thinking_token_budget is not None and reasoning is not None:
        thinking = {"thinking_budget": params.thinking_token_budget,
                    "think_start": reasoning.start, "think_end": reasoning.end}
    return RequestSpec(
        ordinal=ordinal,
        max_tokens=max(0 if scored else 1, min(params.max_tokens, room)),
        sampling=sampling,
        stop_token_ids=tuple(sorted(stops)),
        wants_logprobs=params.wants_logprobs,
        stop_entry=params.stop_token_entry and params.wants_logprobs,
        logprob_token_ids=tuple(params.logprob_token_ids or ()),
        wants_entropy=params.return_entropy,
        scores_prompt=scored,
        **thinking,
    )
