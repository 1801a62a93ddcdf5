"""The coordinator's engine: a step thread that plans, runs, copies and decodes frames.

``generate`` is the asyncio API the HTTP server uses; ``generate_sync`` is the same for
scripts and tests. Every rank runs the same plan: the coordinator sends it to its peers
(``broadcast``) and then runs it on its own shard.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from helios_logprobs.kernels.native import release_openmp_workers
from helios_logprobs.ranks.contract.requests import (
    RequestError,
    check_logprob_request,
    check_min_tokens,
    check_prompt_logprobs,
    check_token_ids,
    context_overflow,
)
from helios_logprobs.ranks.plan import RequestSpec, StepPlan
from helios_logprobs.ranks.step import RankStep
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.engine.executor import FrameExecutor
from helios_logprobs.runtime.engine.frame_reader import SpeculationCounters, read_frame
from helios_logprobs.runtime.engine.pause import PausedCall, PauseState
from helios_logprobs.runtime.engine.prompt_reader import PromptReader
from helios_logprobs.runtime.engine.scheduler import (
    Request,
    Scheduler,
    SchedulerConfig,
    check_thinking_budget,
    request_spec,
)
from helios_logprobs.runtime.engine.sink import WAKEUPS, Sink
from helios_logprobs.runtime.outputs import EngineError, Finished, GeneratedToken, PromptScores


class Engine:
    def __init__(
        self,
        step: RankStep,
        info: EngineInfo,
        config: SchedulerConfig,
        broadcast: Callable[[StepPlan], None] | None = None,
        max_pending_events: int | None = None,
    ) -> None:
        """``max_pending_events``: the bound of each generate() consumer's queue (see Sink);
        None: 64 frames of T events. ``on_step_end``: called on the step thread after each
        step's events are delivered (the engine core's endpoint sends them then)."""
        self.step = step
        self.max_pending_events = max_pending_events or 64 * step.outputs.token_capacity
        self.info = info
        self.config = config
        self.broadcast = broadcast or (lambda plan: None)
        self.scheduler = Scheduler(config)
        self.executor = FrameExecutor(
            step.outputs, step.capabilities.allow_logprobs,
            entropy=None if step.reduction is None else step.reduction.entropy_frames)
        self.prompts = PromptReader(step.scorer) if step.scorer is not None else None
        self.speculation = SpeculationCounters()
        self._lock = threading.Condition()
        self._incoming: list[Request] = []
        self._aborted: set[int] = set()
        self._ordinal = 0
        self._stopped = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self.on_step_end: Callable[[], None] = lambda: None
        self._pause = PauseState()
        self.model_dir: str | None = None
        """The served checkpoint folder (weight updates check a new one against it)."""
        self.weight_updates = {"succeeded": 0, "failed": 0}

    # ----------------------------------------------------------------- public API
    def start(self) -> Engine:
        """Starts the step thread. The calling thread (which built the model) gives up its
        OpenMP workers: from here on the step thread runs the torch work, and a second idle
        pool would slow every parallel region of the step (kernels/native.py)."""
        release_openmp_workers()
        self._thread.start()
        return self

    def healthy(self) -> bool:
        return self._failure is None and not self._stopped

    def load(self) -> tuple[int, int]:
        """(waiting, running): requests submitted but not in a slot (incoming and the
        scheduler's queue), and requests holding a slot. Cheap; any thread may call it (the
        admission limit of the HTTP server and its /metrics read it)."""
        with self._lock:
            incoming = len(self._incoming)
        scheduler = self.scheduler
        return incoming + len(scheduler.waiting), len(scheduler.running)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything refused before admission, as RequestError naming the parameter (for a
        caller that answers before it submits: generate() runs the same check)."""
        checked_spec(self.info, prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GeneratedToken | Finished]:
        sink = Sink(asyncio.get_running_loop(), self.max_pending_events)
        request = self._submit(prompt_ids, params, sink)
        try:
            while True:
                event = await sink.get()
                if isinstance(event, EngineError):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            if not sink.done.is_set():
                self.abort(request)

    def generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, timeout: float = 300.0
    ) -> tuple[list[GeneratedToken], Finished]:
        events = self.events_sync(prompt_ids, params, timeout)
        return [e for e in events if isinstance(e, GeneratedToken)], events[-1]

    def events_sync(
        self, prompt_ids: list[int], params: SamplingParams, timeout: float = 300.0
    ) -> list[PromptScores | GeneratedToken | Finished]:
        """Every event of one request, in order (scripts and tests); raises EngineError."""
        sink = Sink(None, None)
        request = self._submit(prompt_ids, params, sink)
        if not sink.done.wait(timeout):
            self.abort(request)
            raise EngineError(f"request timed out after {timeout} s")
        with sink.lock:
            events = list(sink.events)
        if isinstance(events[-1], EngineError):
            raise events[-1]
        return events

    def run_offline(
        self, jobs: list[tuple[list[int], SamplingParams]]
    ) -> list[list[PromptScores | GeneratedToken | Finished | EngineError]]:
        """Every job's events, stepping on the calling thread (the step thread must not run).
        Plans depend only on the jobs and the emitted tokens, so every rank of a group that
        runs the same greedy or seeded jobs plans the same submissions (tests, benchmarks)."""
        sinks = []
        for prompt_ids, params in jobs:
            sinks.append(Sink(None, None))
            self._submit(prompt_ids, params, sinks[-1])
        with self._lock:
            incoming, self._incoming = self._incoming, []
        while self.step_once(incoming):
            incoming = []
        return [list(sink.events) for sink in sinks]

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink) -> Request:
        """Queue a request whose events go to ``sink`` (any object with Sink's put/put_rows):
        the engine core's endpoint; raises RequestError or EngineError."""
        return self._submit(prompt_ids, params, sink)

    def abort(self, request: Request) -> None:
        with self._lock:
            self._aborted.add(request.ordinal)
            self._lock.notify_all()

    # ----------------------------------------------------------------- pause / resume
    def pause(self, mode: str = "abort", timeout: float | None = None) -> bool:
        """Pause (runtime/engine/pause.py for ``mode``); True once it took effect, False
        after ``timeout`` seconds or when the engine failed meanwhile."""
        with self._lock:
            self._pause.request(mode, self._ordinal)
            self._lock.notify_all()
            return self._lock.wait_for(
                lambda: self._pause.paused or self._failure is not None or self._stopped,
                timeout) and self._pause.paused

    def resume(self) -> None:
        with self._lock:
            left = self._pause.resume()
            self._lock.notify_all()
        for call in left:
            call.future.set_exception(RuntimeError("the engine resumed before the call ran"))

    def is_paused(self) -> bool:
        with self._lock:
            return self._pause.active

    def run_paused(self, fn: Callable[[], object], timeout: float | None = None) -> object:
        """``fn()`` on the step thread while the engine is paused (RuntimeError when it is
        not, or when it resumes first); its result, or its exception raised here."""
        return self._call(PausedCall(fn), timeout)

    def run_between_steps(self, fn: Callable[[], object],
                          timeout: float | None = None) -> object:
        """``fn()`` on the step thread between two steps, paused or not (never call it from
        the step thread); its result, or its exception raised here."""
        return self._call(PausedCall(fn, needs_pause=False), timeout)

    def _call(self, call: PausedCall, timeout: float | None) -> object:
        with self._lock:
            if call.needs_pause and not self._pause.paused:
                raise RuntimeError("the engine is not paused")
            self._pause.calls.append(call)
            self._lock.notify_all()
        return call.future.result(timeout)

    def _has_work(self) -> bool:
        """Under the lock: whether the step thread has anything to do."""
        pause = self._pause
        if self._aborted or pause.settling() or pause.runnable_calls():
            return True
        if pause.paused:
            return False
        return bool(self._incoming) or self.scheduler.has_work()

    def _settle_pause(self, incoming: list[Request], aborted: set[int]) -> None:
        """One iteration while a pause is taking effect (see runtime/engine/pause.py)."""
        mode = self._pause.mode
        if mode == "wait":
            if self.step_once(incoming, aborted):
                return
        elif mode == "abort":
            self._drop_aborted(aborted)
            pending = [r for r in incoming if r.ordinal not in aborted]
            pending += list(self.scheduler.running.values()) + list(self.scheduler.waiting)
            for request in pending:
                if not request.done:
                    self.scheduler.finish(request)
                    request.done = True
                    request.sink.put(Finished("abort"))
            self.on_step_end()
        else:
            for request in incoming:
                self.scheduler.add(request)
            self._drop_aborted(aborted)
        with self._lock:
            if self._pause.settling() and self._pause.mode == mode:
                self._pause.paused = True
                self._lock.notify_all()

    @staticmethod
    def _run_calls(calls: list[PausedCall]) -> None:
        for call in calls:
            try:
                call.future.set_result(call.fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                call.future.set_exception(exc)

    # ----------------------------------------------------------------- step thread
    def _submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> Request:
        """Checks the request (RequestError) and queues it with the spec the check built. The
        ordinal is taken under the lock, so a refused request takes none."""
        with self._lock:
            spec = checked_spec(self.info, prompt_ids, params, self._ordinal + 1,
                                self.scheduler.config.seed)
            if self._failure is not None:
                raise EngineError(f"engine is unhealthy: {self._failure}")
            self._ordinal += 1
            request = Request(self._ordinal, list(prompt_ids), params, spec, sink)
            if params.max_tokens == 0 and params.prompt_logprobs is None:
                sink.put(Finished("length"))
                return request
            self._incoming.append(request)
            self._lock.notify_all()
        return request

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopped and not self._has_work():
                        self._lock.wait(0.5)
                    if self._stopped:
                        break
                    aborted, self._aborted = self._aborted, set()
                    pause = self._pause
                    incoming = [r for r in self._incoming if pause.admissible(r.ordinal)]
                    self._incoming = [r for r in self._incoming  # (held while paused)
                                      if not pause.admissible(r.ordinal)
                                      and r.ordinal not in aborted]
                    settling, calls = pause.settling(), pause.take_calls()
                self._run_calls(calls)
                if settling:
                    self._settle_pause(incoming, aborted)
                elif self._pause.paused:
                    self._drop_aborted(aborted)
                else:
                    self.step_once(incoming, aborted)
        except BaseException as exc:  # noqa: BLE001 - any failure ends every request
            self._fail_all(f"{type(exc).__name__}: {exc}")
            raise

    def step_once(self, incoming: list[Request] = (), aborted: set[int] = frozenset()) -> bool:
        """One iteration of the step thread: admit, drop aborted requests, plan and run one
        submission; False when there was nothing to run. Scripts that drive an engine without
        its thread (every rank of a test group running the same requests) call this."""
        for request in incoming:
            self.scheduler.add(request)
        self._drop_aborted(aborted)
        nxt = self.scheduler.next_plan()
        if nxt is None:
            return False
        self._run(*nxt)
        return True

    def _drop_aborted(self, ordinals: set[int]) -> None:
        if not ordinals:
            return
        for request in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
            if request.ordinal in ordinals:
                self.scheduler.finish(request)

    def _run(self, plan: StepPlan, carried: list[Request]) -> None:
        self.broadcast(plan)
        self.step.run(plan)
        with WAKEUPS.batch():  # (one wake-up per event loop for the whole step)
            self._deliver(plan, carried)
        self.on_step_end()

    def _deliver(self, plan: StepPlan, carried: list[Request]) -> None:
        if plan.scored is not None:
            self._deliver_scores(plan, {r.slot: r for r in carried}[plan.scored.slot])
        sampled = {w.slot for w in plan.work if w.samples}
        sampling = [r for r in carried if r.slot in sampled and not r.done]
        upload = self.step.upload
        host = self.executor.copy(plan.submission, list(upload.requesting_slots),
                                  upload.copy_width, entropy=plan.entropy)
        frame, outcomes = read_frame(host, sampling, self.info.vocab_size)
        token_ids = frame.token_ids.tolist()
        for request in sampling:
            outcome = outcomes[request.ordinal]
            self.speculation.add(request.proposals, outcome)
            start, stop = outcome.start, outcome.stop
            queued = request.sink.put_rows(frame, start, stop) if stop > start else 0
            request.generated.extend(token_ids[start:start + queued])
            if queued < stop - start:
                outcome.error = (
                    f"client too slow: more than {self.max_pending_events} undelivered events"
                )
            if outcome.error is not None:
                self.scheduler.finish(request)
                request.sink.put(EngineError(outcome.error))
            elif outcome.finish is not None:
                self.scheduler.finish(request)
                request.sink.put(outcome.finish)

    def _deliver_scores(self, plan: StepPlan, request: Request) -> None:
        """The scored chunk's entries go out before this frame's generated tokens; a request
        that generates nothing finishes after its last chunk."""
        work = plan.scored
        try:
            entries = self.prompts.read(plan.frame, work, request.params.prompt_logprobs or 0)
        except EngineError as error:
            self.scheduler.finish(request)
            request.sink.put(error)
            return
        if not request.sink.put_prompt(entries):
            self.scheduler.finish(request)
            request.sink.put(EngineError("client too slow: undelivered prompt scores"))
            return
        if request.prefilled == len(request.prompt) and request.spec.max_tokens == 0:
            self.scheduler.finish(request)
            request.sink.put(Finished("length"))

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._failure = reason
            pending = list(self._incoming)
            self._incoming = []
        pending += list(self.scheduler.running.values()) + list(self.scheduler.waiting)
        for request in pending:
            if not request.done:
                request.done = True
                request.sink.put(EngineError(f"request failed: {reason}"))
        self.on_step_end()

    def fail(self, reason: str) -> None:
        """Called from outside the step thread (e.g. a dead peer noticed by the heartbeat)."""
        self._fail_all(reason)
        with self._lock:
            self._stopped = True
            self._lock.notify_all()


def checked_spec(
    info: EngineInfo, prompt_ids: list[int], params: SamplingParams, ordinal: int = 0,
    server_seed: int | None = None,
) -> RequestSpec:
    """The one validation path: everything refused before admission, as RequestError naming
    the parameter, then the spec the ranks receive, built once (its own checks run in
    RowSampling and RequestSpec); ``ordinal`` 0: a check before submission."""
    if not prompt_ids:
        raise RequestError("prompt", "the prompt must contain at least one token")
    check_token_ids("prompt", prompt_ids, info.vocab_size)
    if len(prompt_ids) >= info.max_model_len:
        raise RequestError("prompt", context_overflow(len(prompt_ids), params.max_tokens,
                                                      info.max_model_len))
    check_logprob_request(
        params.logprobs, params.logprob_token_ids, info.vocab_size, info.max_logprobs,
        info.supports_token_ids,
    )
    check_prompt_logprobs(params.prompt_logprobs, info.max_logprobs, info.prompt_logprobs,
                          info.vocab_size)
    check_token_ids("stop_token_ids", params.stop_token_ids, info.vocab_size)
    check_token_ids("allowed_token_ids", params.allowed_token_ids or (), info.vocab_size)
    check_token_ids("logit_bias", [t for t, _ in params.logit_bias], info.vocab_size)
    check_thinking_budget(params.thinking_token_budget, info.reasoning)
    check_min_tokens(params.min_tokens, params.max_tokens)
    check_token_ids("bad_words", [t for w in params.bad_words for t in w], info.vocab_size)
    if not isinstance(params.return_entropy, bool):
        raise RequestError("return_entropy", f"must be a boolean, got {params.return_entropy!r}")
    if params.return_entropy and not params.wants_logprobs:
        raise RequestError("return_entropy", "requires logprobs (the entropy is reported "
                                             "beside each position's logprob)")
    if not isinstance(params.speculative, bool):
        raise RequestError("speculative", f"must be a boolean, got {params.speculative!r}")
    return request_spec(info, ordinal, prompt_ids, params, info.reasoning, server_seed)
