"""Admission control and GET /metrics (the Prometheus text format, via prometheus_client).

`Admission` bounds the engine requests (one per choice) a server holds: waiting + running.
The HTTP server reserves a request's choices before it reaches the engine and releases them
when its response ends (finished, failed, or its client gone); the count it compares with
the limit is the larger of its own reservations and the engine's `load()`. Beyond the limit a
request gets HTTP 429 with `Retry-After`, and nothing of it reaches the engine. Everything
here is changed on the event loop only; the scrape reads plain integers.

Metrics (vLLM's names with the `helios:` prefix for `vllm:`; the mapping is in docs/api.md):
the queue gauges and KV-cache usage, token and request counters, time to first token,
inter-token and end-to-end latency histograms, the copy counters of the coordinator's frame
executor and prompt reader, the speculative rounds' drafts and accepted tokens, rejections by
reason, and the frame bytes of the rank step (ranks.capacity.sizing.frame_bytes), the
completion frames apart from the scored and host ones; dynamo's compile counters and, on
CUDA, the device allocator's bytes (RankStep.serve_stats, rank 0's process). The engine's
values come from the engine (in an API server: the engine core's latest report); the
server's own are added up over every API server (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from helios_logprobs.runtime.outputs import Finished, GeneratedToken

disable_created_metrics()  # (no *_created series: vLLM's /metrics has none either)

PREFIX = "helios:"
QUEUE_FACTOR = 4
"""The default admission limit: this many requests per physical slot (waiting + running)."""
RETRY_AFTER_S = 1


def default_queue_limit(capacity: int) -> int:
    return QUEUE_FACTOR * capacity


LATENCY_BUCKETS = {  # vLLM's buckets (vllm/v1/metrics/loggers.py)
    "time_to_first_token_seconds": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency_seconds": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0),
    "e2e_request_latency_seconds": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
}
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "too_large")


def multiprocess_dir() -> str | None:
    """Where the API server processes share their metrics (prometheus_client's multiprocess
    mode, as vLLM's API servers do); None: this process counts alone."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class ServerStats:
    """What the HTTP server counts and times, as prometheus_client metrics (event loop only).
    Under PROMETHEUS_MULTIPROC_DIR every API server writes them to that folder and /metrics
    adds them up over all of them."""

    def __init__(self) -> None:
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=None)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens",
                                         registry=None)
        self.finished = Counter(PREFIX + "request_success", "Finished choices by finish "
                                "reason", ["finished_reason"], registry=None)
        self.logprob_requests = Counter(PREFIX + "requests_with_logprobs", "Admitted "
                                        "requests that asked for logprobs or prompt logprobs",
                                        registry=None)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before any "
                                "work, by reason", ["reason"], registry=None)
        self.admitted = Gauge(PREFIX + "num_requests_admitted", "Engine requests admitted by "
                              "the HTTP server whose responses have not ended", registry=None,
                              multiprocess_mode="livesum")
        self.latency = {
            name: Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS[name], registry=None)
            for name, doc in (
                ("time_to_first_token_seconds", "Time from a request's submission to the "
                 "engine to its first generated token"),
                ("inter_token_latency_seconds", "Time between a request's consecutive "
                 "generated tokens"),
                ("e2e_request_latency_seconds", "Time from a request's submission to the "
                 "engine to its end"),
            )}
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)

    def collectors(self) -> list:
        return [self.prompt_tokens, self.generation_tokens, self.finished,
                self.logprob_requests, self.rejected, self.admitted, *self.latency.values()]

    def finish(self, reason: str | None) -> None:
        self.finished.labels(reason or "abort").inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()


class Observed:
    """The engine as the endpoints see it: ``generate`` also times each request (time to
    first token, inter-token latencies, end-to-end latency, vLLM's three histograms)."""

    def __init__(self, engine: Any, stats: ServerStats) -> None:
        self._engine = engine
        ttft, itl, e2e = (stats.latency[name] for name in LATENCY_BUCKETS)
        self._observe = ttft.observe, itl.observe, e2e.observe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params):
        first, between, whole = self._observe
        start = last = time.monotonic()
        tokens = 0
        async with contextlib.aclosing(self._engine.generate(prompt_ids, params)) as events:
            async for event in events:
                if isinstance(event, GeneratedToken):
                    now = time.monotonic()
                    (between if tokens else first)(now - last)
                    tokens += 1
                    last = now
                elif isinstance(event, Finished):
                    whole(time.monotonic() - start)
                yield event


class Admission:
    """The waiting + running bound (None: unbounded)."""

    def __init__(self, engine: Any, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {limit}")
        self.engine = engine
        self.limit = limit
        self.reserved = 0
        """Engine requests admitted by the server whose responses have not ended."""

    def engine_load(self) -> tuple[int, int]:
        load = getattr(self.engine, "load", None)
        return load() if load is not None else (0, 0)

    def busy(self) -> int:
        return max(self.reserved, sum(self.engine_load()))

    def try_admit(self, count: int) -> bool:
        """Reserve `count` engine requests; False (nothing reserved) when they do not fit. A
        request larger than the whole limit is admitted only into an idle server."""
        busy = self.busy()
        if self.limit is not None and busy > 0 and busy + count > self.limit:
            return False
        self.reserved += count
        return True

    def release(self, count: int) -> None:
        self.reserved -= count


class CoreCollector:
    """The engine's live values at each scrape: queue gauges, KV-cache usage, the copy
    counters of the coordinator's frame executor and prompt reader, the speculative rounds'
    drafts and accepted tokens (vLLM's spec_decode_* names), and the frame bytes of the rank
    step. An API server reads them from the engine core's latest report (one copy, whichever
    API server is asked)."""

    def __init__(self, engine: Any, admission: Admission) -> None:
        self.engine = engine
        self.admission = admission
        self.frames = frame_bytes_of(engine)

    def collect(self) -> Iterator[Metric]:
        waiting, running = self.admission.engine_load()
        yield _gauge("num_requests_waiting", "Requests submitted to the engine, not yet in a "
                     "slot", waiting)
        yield _gauge("num_requests_running", "Requests holding an engine slot", running)
        usage = getattr(self.engine, "kv_cache_usage", None)
        if usage is not None:
            yield _gauge("kv_cache_usage_perc", "Fraction of the KV cache's token positions "
                         "held by running requests (0 to 1)", usage())
        if self.admission.limit is not None:
            yield _gauge("max_queued_requests", "Admission limit on waiting + running",
                         self.admission.limit)
        executor = getattr(self.engine, "executor", None)
        counters = getattr(executor, "counters", None)
        if counters is not None:
            yield _counter("frames_copied", "Completion frames copied to the host",
                           counters.frames)
            yield _counter("payload_bytes_copied", "Logprob payload bytes copied to the host",
                           counters.payload_bytes)
            yield _counter("record_bytes_copied", "Completion record bytes copied to the host",
                           counters.record_bytes)
        speculation = getattr(self.engine, "speculation", None)
        if speculation is not None:
            yield _counter("spec_decode_num_drafts", "Speculative rounds (decodes that "
                           "verified proposals)", speculation.rounds)
            yield _counter("spec_decode_num_draft_tokens", "Proposed tokens offered for "
                           "verification", speculation.offered)
            yield _counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                           speculation.accepted)
            yield _counter("spec_decode_num_emitted_tokens", "Tokens emitted by speculative "
                           "rounds (accepted, corrections and bonus tokens)",
                           speculation.emitted)
        prompts = getattr(self.engine, "prompts", None)
        if prompts is not None:
            yield _counter("prompt_logprob_rows", "Scored prompt rows copied to the host",
                           prompts.rows_copied)
            yield _counter("prompt_logprob_bytes_copied", "Scored prompt row bytes copied to "
                           "the host", prompts.bytes_copied)
        if self.frames is not None:
            frames = GaugeMetricFamily(PREFIX + "frame_bytes", "Bytes of the rank step's "
                                       "frames: completion and scored on each rank's device, "
                                       "host on the coordinator", labels=["frame"])
            for name in ("completion", "scored", "host"):
                frames.add_metric([name], self.frames[name])
            yield frames
        yield from step_metrics(step_stats_of(self.engine))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


COMPILE_COUNTERS = {
    "compile_graphs": "Graphs dynamo compiled in the engine core's process (rank 0), "
                      "recompilations included",
    "compile_graph_breaks": "Graph breaks dynamo met in the engine core's process (rank 0)",
    "compile_recompilations": "Graphs dynamo compiled after the rank step was built (a "
                              "recompilation or a compile while serving; 0 when --compile "
                              "compiled everything at start-up)",
}
DEVICE_MEMORY = ("allocated", "reserved", "graph_pool")


def step_stats_of(engine: Any) -> dict[str, int]:
    """The rank step's compile counters and device memory (RankStep.serve_stats): what the
    engine core reported, or an in-process engine's step's own."""
    counters = getattr(getattr(engine, "stats", None), "counters", None)
    if isinstance(counters, dict):
        return {name: value for name, value in counters.items()
                if name.startswith(("compile_", "device_memory_"))}
    serve_stats = getattr(getattr(engine, "step", None), "serve_stats", None)
    return serve_stats() if callable(serve_stats) else {}


def step_metrics(stats: dict[str, int]) -> Iterator[Metric]:
    """helios:compile_* counters, and helios:device_memory_bytes{kind=allocated|reserved|
    graph_pool} on CUDA (absent on the CPU, which has no device allocator to read)."""
    for name, doc in COMPILE_COUNTERS.items():
        if name in stats:
            yield _counter(name, doc, stats[name])
    if any(f"device_memory_{kind}" in stats for kind in DEVICE_MEMORY):
        memory = GaugeMetricFamily(PREFIX + "device_memory_bytes", "The rank step's device "
                                   "allocator on rank 0: bytes allocated and reserved, and "
                                   "reserved by CUDA graph pools (0 until a graph is "
                                   "captured)",
                                   labels=["kind"])
        for kind in DEVICE_MEMORY:
            memory.add_metric([kind], stats.get(f"device_memory_{kind}", 0))
        yield memory


def frame_bytes_of(engine: Any) -> dict[str, int] | None:
    """The rank step's frame bytes: an in-process engine's, or those the core reported."""
    reported = getattr(engine, "frame_bytes", None)
    if isinstance(reported, dict):
        return reported
    config = getattr(getattr(engine, "step", None), "config", None)
    if config is None:
        return None
    from helios_logprobs.ranks.capacity.sizing import frame_bytes

    return frame_bytes(config).as_dict()


class Metrics:
    """The server's registry (one per app, so tests may build many apps): the engine's live
    values, and the server's own metrics, added up over every API server in multiprocess
    mode."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any, admission: Admission, stats: ServerStats) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoreCollector(engine, admission))
        shared = multiprocess_dir()
        if shared is not None:
            MultiProcessCollector(self.registry, shared)
        else:
            for collector in stats.collectors():
                self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
