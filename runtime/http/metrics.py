"""Admission control and GET /metrics (the Prometheus text format, via prometheus_client).

`Admission` bounds the engine requests (one per choice) a server holds: waiting + running.
The HTTP server reserves a request's choices before it reaches the engine and releases them
when its response ends (finished, failed, or its client gone); the count it compares with
the limit is the larger of its own reservations and the engine's `load()`. Beyond the limit a
request gets HTTP 429 with `Retry-After`, and nothing of it reaches the engine. Everything
here is changed on the event loop only; the scrape reads plain integers.

Metrics (names in vLLM's style, prefixed `helios:`): the queue gauges, token and request
counters, the copy counters of the coordinator's frame executor and prompt reader, the
speculative rounds' drafts and accepted tokens (vLLM's spec_decode_* names), rejections by
reason, and the frame bytes of the rank step (ranks.capacity.sizing.frame_bytes), the completion
frames apart from the scored and host ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "helios:"
QUEUE_FACTOR = 4
"""The default admission limit: this many requests per physical slot (waiting + running)."""
RETRY_AFTER_S = 1


def default_queue_limit(capacity: int) -> int:
    return QUEUE_FACTOR * capacity


@dataclass
class ServerStats:
    """Counters of the HTTP server (event loop only)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    """Choices by finish reason (`stop`, `length`, `abort`: client gone, `error`)."""
    logprob_requests: int = 0
    rejected: Counter = field(default_factory=Counter)
    """Requests refused before any work, by reason: `queue_full` (429), `too_large` (413)."""


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


class ServerCollector:
    """Reads the live values at each scrape."""

    def __init__(self, engine: Any, admission: Admission, stats: ServerStats) -> None:
        self.engine = engine
        self.admission = admission
        self.stats = stats
        self.frames = _frame_bytes(engine)

    def collect(self) -> Iterator[Metric]:
        waiting, running = self.admission.engine_load()
        yield _gauge("num_requests_waiting", "Requests submitted to the engine, not yet in a "
                     "slot", waiting)
        yield _gauge("num_requests_running", "Requests holding an engine slot", running)
        yield _gauge("num_requests_admitted", "Engine requests admitted by the HTTP server "
                     "whose responses have not ended", self.admission.reserved)
        if self.admission.limit is not None:
            yield _gauge("max_queued_requests", "Admission limit on waiting + running",
                         self.admission.limit)
        stats = self.stats
        yield _counter("prompt_tokens", "Prompt tokens of admitted requests",
                       stats.prompt_tokens)
        yield _counter("generation_tokens", "Generated tokens", stats.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished choices by finish "
                                      "reason", labels=["finished_reason"])
        for reason in sorted(set(stats.finished) | {"stop", "length", "abort", "error"}):
            success.add_metric([reason], stats.finished[reason])
        yield success
        yield _counter("requests_with_logprobs", "Admitted requests that asked for logprobs "
                       "or prompt logprobs", stats.logprob_requests)
        rejected = CounterMetricFamily(PREFIX + "requests_rejected", "Requests refused before "
                                       "any work, by reason", labels=["reason"])
        for reason in sorted(set(stats.rejected) | {"queue_full", "too_large"}):
            rejected.add_metric([reason], stats.rejected[reason])
        yield rejected
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


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _frame_bytes(engine: Any) -> dict[str, int] | None:
    config = getattr(getattr(engine, "step", None), "config", None)
    if config is None:
        return None
    from helios_logprobs.ranks.capacity.sizing import frame_bytes

    return frame_bytes(config).as_dict()


class Metrics:
    """The server's registry (one per app, so tests may build many apps)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Any, admission: Admission, stats: ServerStats) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(engine, admission, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
