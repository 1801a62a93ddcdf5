"""The engine core's endpoint: requests in from the API servers, one StepOutputs per step out.

An input thread decodes Hello / Ready / Submit / Abort and hands requests to the engine; the
step thread's events go into one StepPacker per API server (``RemoteSink``) and leave once per
step (``Engine.on_step_end``), or at once for what the input thread itself caused (a request
refused or finished at submission). An API server that is gone (``server_gone``) or that does
not read its outputs for the send timeout has its requests aborted; the others keep going."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from helios_logprobs.collectives.codec import CodecError, decode, encode
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.engine import Engine
from helios_logprobs.runtime.engine.frame_tokens import FrameTokens
from helios_logprobs.runtime.engine.prompt_reader import PromptArrays
from helios_logprobs.runtime.engine.weight_update import WeightControl
from helios_logprobs.runtime.frontend.messages import (
    Abort,
    ControlCall,
    ControlReply,
    CoreStats,
    Hello,
    Ready,
    Shutdown,
    Submit,
    Welcome,
)
from helios_logprobs.runtime.frontend.packing import StepPacker
from helios_logprobs.runtime.outputs import EngineError, Finished

log = logging.getLogger("helios_logprobs.runtime.frontend")
STATS_EVERY_S = 0.5
"""An idle core still sends its gauges this often (the API servers' /metrics and /health)."""


def core_stats(engine: Engine) -> CoreStats:
    waiting, running = engine.load()
    scheduler = engine.scheduler
    config = scheduler.config
    held = sum(len(r.prompt) + len(r.generated) for r in list(scheduler.running.values()))
    positions = config.capacity * config.max_seq_len
    counters = engine.executor.counters
    speculation = engine.speculation
    values = {
        "frames_copied": counters.frames, "payload_bytes_copied": counters.payload_bytes,
        "record_bytes_copied": counters.record_bytes,
        "spec_decode_num_drafts": speculation.rounds,
        "spec_decode_num_draft_tokens": speculation.offered,
        "spec_decode_num_accepted_tokens": speculation.accepted,
        "spec_decode_num_emitted_tokens": speculation.emitted,
    }
    for outcome, count in getattr(engine, "weight_updates", {}).items():
        values[f"rl_weight_update_{outcome}"] = count
    if engine.prompts is not None:
        values["prompt_logprob_rows"] = engine.prompts.rows_copied
        values["prompt_logprob_bytes_copied"] = engine.prompts.bytes_copied
    serve_stats = getattr(getattr(engine, "step", None), "serve_stats", None)
    if serve_stats is not None:  # (compile counters, device memory: runtime/http/metrics.py)
        values.update(serve_stats())
    return CoreStats(engine.healthy(), waiting, running,
                     min(1.0, held / positions) if positions else 0.0, values)


class RemoteSink:
    """A Sink whose events go to one API server's packer (never refused: the API server holds
    each request's bound and aborts a request whose client is too slow)."""

    __slots__ = ("endpoint", "server", "request_id")

    def __init__(self, endpoint: CoreEndpoint, server: int, request_id: int) -> None:
        self.endpoint = endpoint
        self.server = server
        self.request_id = request_id

    def put(self, event) -> bool:
        return self.put_all((event,)) == 1

    def put_all(self, events) -> int:
        return self.endpoint.collect(self.server, self.request_id, events)

    def put_rows(self, frame: FrameTokens, start: int, stop: int) -> int:
        self.endpoint.collect_rows(self.server, self.request_id, frame, start, stop)
        return stop - start

    def put_prompt(self, scores: PromptArrays) -> bool:
        with self.endpoint.lock:
            self.endpoint.packers[self.server].add_prompt(self.request_id, scores)
        return True


class CoreEndpoint:
    def __init__(self, engine: Engine, sockets, count: int, frame_bytes: dict | None) -> None:
        self.engine = engine
        self.sockets = sockets
        self.count = count
        self.frame_bytes = frame_bytes
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        """Held from taking a step's events to sending them: the messages leave in order."""
        self.packers = [StepPacker() for _ in range(count)]
        self.requests: dict[tuple[int, int], object] = {}
        self.gone: set[int] = set()
        self.ready: dict[int, int] = {}
        self.ready_changed = threading.Condition()
        self.stopped = False
        self._last_stats = 0.0
        self._healthy = True
        engine.on_step_end = self.flush
        self._thread = threading.Thread(target=self._loop, name="core-input", daemon=True)

    def start(self) -> CoreEndpoint:
        self._thread.start()
        return self

    # ------------------------------------------------------------------ outputs
    def collect(self, server: int, request_id: int, events) -> int:
        with self.lock:
            packer = self.packers[server]
            for event in events:
                packer.add(request_id, event)
                if isinstance(event, (Finished, EngineError)):
                    self.requests.pop((server, request_id), None)
        return len(events)

    def collect_rows(self, server: int, request_id: int, frame: FrameTokens, start: int,
                     stop: int) -> None:
        with self.lock:
            self.packers[server].add_rows(request_id, frame, start, stop)

    def flush(self) -> None:
        """Send every API server its events since the last flush, with the core's gauges."""
        stats = core_stats(self.engine)
        self._last_stats = time.monotonic()
        if not stats.healthy and self._healthy:  # (every API server's /health: 503 now)
            self._healthy = False
            self.send_stats()
        with self.send_lock:
            with self.lock:
                taken = [(i, p.take(stats)) for i, p in enumerate(self.packers)
                         if p and i not in self.gone]
            for index, outputs in taken:
                if not self.sockets.send(index, encode(outputs)):
                    self.server_gone(index, "it did not read its outputs")

    def send_stats(self) -> None:
        stats = core_stats(self.engine)
        self._last_stats = time.monotonic()
        payload = encode(stats)
        for index in range(self.count):
            if index not in self.gone and index in self.ready:
                self.sockets.send(index, payload, timeout_ms=0)  # (a later one will do)

    def shutdown(self, reason: str) -> None:
        payload = encode(Shutdown(reason))
        for index in range(self.count):
            if index not in self.gone:
                self.sockets.send(index, payload, timeout_ms=1000)

    # ------------------------------------------------------------------ failures
    def server_gone(self, index: int, why: str, quiet: bool = False) -> None:
        """Abort every request of API server ``index``; it gets nothing more. ``quiet``: an
        API server that exits when told to (no error line)."""
        with self.lock:
            if index in self.gone:
                return
            self.gone.add(index)
            mine = [key for key in self.requests if key[0] == index]
            requests = [self.requests.pop(key) for key in mine]
            self.packers[index] = StepPacker()
        self.sockets.drop(index)
        for request in requests:
            self.engine.abort(request)
        if not quiet:
            log.error("API server %d is gone (%s): %d request(s) aborted", index, why,
                      len(requests))
        with self.ready_changed:
            self.ready_changed.notify_all()

    # ------------------------------------------------------------------ inputs
    def _loop(self) -> None:
        while not self.stopped:
            data = self.sockets.receive(100)
            if data is not None:
                try:
                    self._handle(decode(data))
                except CodecError as exc:
                    log.error("dropped a malformed message from an API server: %s", exc)
                except Exception:  # noqa: BLE001 - one bad message never ends the endpoint
                    log.exception("an API server's message failed")
            if time.monotonic() - self._last_stats >= STATS_EVERY_S:
                self.send_stats()

    def _handle(self, msg) -> None:
        if isinstance(msg, Submit):
            self._submit(msg)
            self.flush()
        elif isinstance(msg, Abort):
            with self.lock:
                requests = [self.requests.pop((msg.index, rid), None) for rid in msg.request_ids]
            for request in requests:
                if request is not None:
                    self.engine.abort(request)
        elif isinstance(msg, Hello):
            welcome = Welcome(self.engine.info, self.engine.config.capacity,
                              self.engine.max_pending_events, self.frame_bytes,
                              core_stats(self.engine))
            self.sockets.send(msg.index, encode(welcome))
        elif isinstance(msg, ControlCall):  # (blocking calls: a thread each)
            threading.Thread(target=self._control, args=(msg,), name="core-control",
                             daemon=True).start()
        elif isinstance(msg, Ready):
            with self.ready_changed:
                self.ready[msg.index] = msg.port
                self.ready_changed.notify_all()

    def _control(self, msg: ControlCall) -> None:
        try:
            status, body = WeightControl.for_engine(self.engine).handle(msg.op, msg.args)
        except Exception as exc:  # noqa: BLE001 - the caller gets a 500
            log.exception("control operation %s failed", msg.op)
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}", "param": None}
        self.send_stats()  # (counters the answer changed, before the answer)
        if msg.index not in self.gone:
            self.sockets.send(msg.index, encode(ControlReply(msg.call_id, status, body)))

    def _submit(self, msg: Submit) -> None:
        if msg.index in self.gone:
            return
        sink = RemoteSink(self, msg.index, msg.request_id)
        key = (msg.index, msg.request_id)
        try:
            with self.lock:  # (registered before a step can finish it)
                self.requests[key] = None
            request = self.engine.submit(np.asarray(msg.prompt_ids).tolist(), msg.params, sink)
        except (RequestError, EngineError) as exc:
            with self.lock:
                self.requests.pop(key, None)
            sink.put(EngineError(str(exc)))
            return
        with self.lock:
            if key in self.requests:  # (not finished already)
                self.requests[key] = request

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every API server listens within ``timeout_s`` (False: one is gone)."""
        deadline = time.monotonic() + timeout_s
        with self.ready_changed:
            while len(self.ready) < self.count:
                left = deadline - time.monotonic()
                if left <= 0 or self.gone:
                    return False
                self.ready_changed.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        self.stopped = True
        for index in range(self.count):
            self.server_gone(index, "closing", quiet=True)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
