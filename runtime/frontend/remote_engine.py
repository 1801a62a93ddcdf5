"""The engine as an API server process sees it: an EngineClient over the core's sockets.

``generate`` sends a Submit and yields what the core's StepOutputs carry for it; the request
is aborted in the core when the consumer stops early (client gone, stop string found). Each
request holds at most ``max_pending_events`` undelivered events here (the engine's Sink
bound): a client that reads slower ends with EngineError("client too slow") and its request
is aborted, so neither this process nor the core buffers for it. A receiving thread decodes
the core's messages; ``fail`` (the core gone) ends every request with EngineError."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from helios_logprobs.collectives.codec import CodecError, decode, encode
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.engine import checked_spec
from helios_logprobs.runtime.engine.sink import WAKEUPS, Sink
from helios_logprobs.runtime.frontend.messages import (
    Abort,
    ControlCall,
    ControlReply,
    CoreStats,
    Hello,
    Ready,
    Shutdown,
    StepOutputs,
    Submit,
    Welcome,
)
from helios_logprobs.runtime.frontend.packing import unpack
from helios_logprobs.runtime.outputs import EngineError, Finished, GeneratedToken, PromptScores

log = logging.getLogger("helios_logprobs.runtime.frontend")


@dataclass(frozen=True)
class CoreLimits:
    """What create_app reads of an engine's configuration (its default admission limit)."""

    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")


class RemoteEngine:
    def __init__(self, sockets, index: int, welcome_timeout_s: float = 120.0) -> None:
        self.sockets = sockets
        self.index = index
        self.sockets.send(encode(Hello(index)))
        welcome = self._welcome(welcome_timeout_s)
        self.info = welcome.info
        self.config = CoreLimits(welcome.capacity)
        self.max_pending_events = welcome.max_pending_events
        self.frame_bytes = welcome.frame_bytes
        self.stats: CoreStats = welcome.stats
        self.executor = SimpleNamespace(counters=SimpleNamespace())
        self.speculation = SimpleNamespace()
        self.prompts = SimpleNamespace() if "prompt_logprob_rows" in self.stats.counters \
            else None
        self._mirror(self.stats)
        self._sinks: dict[int, Sink] = {}
        self._ids = itertools.count(1)
        self._failure: str | None = None
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.on_shutdown = lambda reason: None
        self._stopped = False
        self._thread = threading.Thread(target=self._receive, name="core-outputs", daemon=True)
        self._thread.start()

    def _welcome(self, timeout_s: float) -> Welcome:
        data = self.sockets.receive(int(timeout_s * 1000))
        if data is None:
            raise RuntimeError(f"the engine core did not answer within {timeout_s:.0f} s")
        welcome = decode(data)
        if not isinstance(welcome, Welcome):
            raise RuntimeError(f"expected Welcome from the engine core, got {welcome!r:.80}")
        return welcome

    def _mirror(self, stats: CoreStats) -> None:
        """The core's counters where metrics.ServerCollector reads an in-process engine's."""
        self.stats = stats
        counters = stats.counters
        self.executor.counters.frames = counters.get("frames_copied", 0)
        self.executor.counters.payload_bytes = counters.get("payload_bytes_copied", 0)
        self.executor.counters.record_bytes = counters.get("record_bytes_copied", 0)
        spec = self.speculation
        spec.rounds = counters.get("spec_decode_num_drafts", 0)
        spec.offered = counters.get("spec_decode_num_draft_tokens", 0)
        spec.accepted = counters.get("spec_decode_num_accepted_tokens", 0)
        spec.emitted = counters.get("spec_decode_num_emitted_tokens", 0)
        if self.prompts is not None:
            self.prompts.rows_copied = counters.get("prompt_logprob_rows", 0)
            self.prompts.bytes_copied = counters.get("prompt_logprob_bytes_copied", 0)

    # ------------------------------------------------------------------ EngineClient
    def healthy(self) -> bool:
        return self._failure is None and self.stats.healthy

    def load(self) -> tuple[int, int]:
        return self.stats.waiting, self.stats.running

    def kv_cache_usage(self) -> float:
        return self.stats.kv_cache_usage

    def ready(self, port: int) -> None:
        self.sockets.send(encode(Ready(self.index, port)))

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        checked_spec(self.info, prompt_ids, params)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[PromptScores | GeneratedToken | Finished]:
        """The request's events. The caller has checked it (``check``: the endpoints do, for
        every choice, before anything streams); the engine core builds its spec once more,
        with the ordinal, and refuses it there with an error event."""
        if self._failure is not None:
            raise EngineError(f"engine is unhealthy: {self._failure}")
        sink = Sink(asyncio.get_running_loop(), self.max_pending_events)
        request_id = next(self._ids)
        self._sinks[request_id] = sink
        submit = Submit(self.index, request_id, np.asarray(prompt_ids, dtype=np.int64), params)
        try:
            if not self.sockets.send(encode(submit)):
                raise EngineError("the engine core is not taking requests")
            while True:
                event = await sink.get()
                if isinstance(event, EngineError):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not sink.done.is_set():
                sink.done.set()
                self.sockets.send(encode(Abort(self.index, (request_id,))))

    async def control(self, op: str, args: dict) -> tuple[int, dict]:
        """An operation on the engine core (runtime/engine/weight_update.py): its HTTP status
        and JSON body."""
        if self._failure is not None:
            raise EngineError(f"engine is unhealthy: {self._failure}")
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        self._calls[call_id] = (loop, answer := loop.create_future())
        try:
            if not self.sockets.send(encode(ControlCall(self.index, call_id, op, dict(args)))):
                raise EngineError("the engine core is not taking requests")
            return await answer
        finally:
            self._calls.pop(call_id, None)

    def fail(self, reason: str) -> None:
        """End every request in flight with EngineError (the core is gone)."""
        if self._failure is None:
            self._failure = reason
        for sink in list(self._sinks.values()):
            sink.put(EngineError(f"request failed: {reason}"))
        for loop, answer in list(self._calls.values()):
            loop.call_soon_threadsafe(_settle, answer, EngineError(f"engine failed: {reason}"))

    def close(self) -> None:
        self._stopped = True
        self._thread.join(timeout=2)
        self.sockets.close()

    # ------------------------------------------------------------------ receiving thread
    def _receive(self) -> None:
        while not self._stopped:
            data = self.sockets.receive(200)
            if data is None:
                continue
            try:
                msg = decode(data)
            except CodecError as exc:
                log.error("dropped a malformed message from the engine core: %s", exc)
                continue
            if isinstance(msg, StepOutputs):
                self._deliver(msg)
                self._mirror(msg.stats)
            elif isinstance(msg, CoreStats):
                self._mirror(msg)
            elif isinstance(msg, Shutdown):
                self.on_shutdown(msg.reason)
            elif isinstance(msg, ControlReply) and msg.call_id in self._calls:
                loop, answer = self._calls[msg.call_id]
                loop.call_soon_threadsafe(_settle, answer, (msg.status, msg.body))

    def _deliver(self, outputs: StepOutputs) -> None:
        too_slow: list[int] = []
        sinks = self._sinks
        with WAKEUPS.batch():
            for request_id, event in _grouped(unpack(outputs)):
                sink = sinks.get(request_id)
                if sink is None:
                    continue
                if sink.put_all(event) < len(event):
                    sink.put(EngineError(f"client too slow: more than "
                                         f"{self.max_pending_events} undelivered events"))
                    too_slow.append(request_id)
        if too_slow:
            self.sockets.send(encode(Abort(self.index, tuple(too_slow))))


def _settle(answer: asyncio.Future, outcome) -> None:
    if not answer.done():
        if isinstance(outcome, BaseException):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)


def _grouped(events):
    """Consecutive events of one request as one list (one put_all, one wake-up)."""
    for request_id, group in itertools.groupby(events, key=lambda pair: pair[0]):
        yield request_id, [event for _, event in group]
