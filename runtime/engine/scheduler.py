"""Admission, slots, epochs and chunked prefill: turns waiting requests into step plans."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ranks.plan import RequestSpec, SlotWork, StepPlan
from runtime.engine.client import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    capacity: int
    max_seq_len: int
    chunk_size: int = 256
    max_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.chunk_size < 1 or self.max_batched_tokens < 1:
            raise ValueError("capacity, chunk_size and max_batched_tokens must be >= 1")


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

    @property
    def wants_logprobs(self) -> bool:
        return self.spec.logprobs


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.epochs = [0] * config.capacity
        self.submission = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        request.done = True
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
            work.append(SlotWork(request.slot, request.epoch, (request.generated[-1],), position,
                                 samples=True))
            carried.append(request)
            budget -= 1
        scored = False
        for request in prefills:
            take = min(self.config.chunk_size, budget, len(request.prompt) - request.prefilled)
            if take < 1:
                break
            if request.spec.prompt_logprobs and scored:
                continue  # one scored chunk per submission: it waits for the next one
            start = request.prefilled
            chunk = tuple(request.prompt[start : start + take])
            last = start + take == len(request.prompt)
            first = start == 0
            targets = (scored_targets(request.prompt, start, take)
                       if request.spec.prompt_logprobs else ())
            scored = scored or bool(targets)
            work.append(SlotWork(request.slot, request.epoch, chunk, start,
                                 samples=last and request.spec.max_tokens > 0,
                                 request=request.spec if first else None, targets=targets))
            request.prefilled += take
            carried.append(request)
            budget -= take
        if not work:
            return None
        plan = StepPlan(self.submission, tuple(work))
        self.submission += 1
        return plan, carried


def scored_targets(prompt: list[int], start: int, take: int) -> tuple[int, ...]:
    """A scored chunk's targets: row j predicts prompt[start + j + 1]; -1 at the prompt end."""
    targets = prompt[start + 1 : start + take + 1]
    return (*targets, *([-1] * (take - len(targets))))
