"""The typed messages between the engine core and its API server processes (one codec:
collectives/codec.py). API server -> core: Hello, Ready, Submit, Abort, ControlCall. Core ->
API server: Welcome, StepOutputs (one per step: arrays, no per-token objects), CoreStats,
Shutdown, ControlReply."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from helios_logprobs.collectives.codec import message, register
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.text.reasoning import ReasoningStrings, ReasoningTokens

register(EngineInfo, "fe_engine_info")
register(SamplingParams, "fe_sampling_params")
register(ReasoningTokens, "fe_reasoning_tokens")
register(ReasoningStrings, "fe_reasoning_strings")


def _check_index(index: int) -> None:
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"API server index must be an int >= 0, got {index!r}")


@message("fe_hello")
@dataclass(frozen=True)
class Hello:
    """An API server connected (it waits for Welcome)."""

    index: int

    def __post_init__(self) -> None:
        _check_index(self.index)


@message("fe_ready")
@dataclass(frozen=True)
class Ready:
    """An API server listens."""

    index: int
    port: int

    def __post_init__(self) -> None:
        _check_index(self.index)


@message("fe_submit")
@dataclass(frozen=True)
class Submit:
    """One engine request (one choice), already tokenized and checked on the API server."""

    index: int
    request_id: int
    prompt_ids: np.ndarray
    params: SamplingParams

    def __post_init__(self) -> None:
        _check_index(self.index)
        if self.prompt_ids.ndim != 1 or self.prompt_ids.dtype.kind != "i":
            raise ValueError(f"prompt_ids: a 1-d int array, got {self.prompt_ids.dtype}"
                             f"{list(self.prompt_ids.shape)}")


@message("fe_abort")
@dataclass(frozen=True)
class Abort:
    """The API server no longer wants these requests (client gone, stop string found)."""

    index: int
    request_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_index(self.index)


@message("fe_control_call")
@dataclass(frozen=True)
class ControlCall:
    """An operation on the engine core outside of requests (runtime/engine/weight_update.py:
    pause, resume, is_paused, update_weights), answered by one ControlReply."""

    index: int
    call_id: int
    op: str
    args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_index(self.index)


@message("fe_control_reply")
@dataclass(frozen=True)
class ControlReply:
    """A ControlCall's answer: an HTTP status and a JSON body."""

    call_id: int
    status: int
    body: dict


@message("fe_core_stats")
@dataclass(frozen=True)
class CoreStats:
    """The engine core's gauges and counters (what /metrics shows of it) and its health."""

    healthy: bool
    waiting: int
    running: int
    kv_cache_usage: float
    """Fraction of the KV cache's token positions held by running requests (0..1)."""
    counters: dict[str, int] = field(default_factory=dict)


@message("fe_welcome")
@dataclass(frozen=True)
class Welcome:
    """The core's answer to Hello: what every API server needs to serve."""

    info: EngineInfo
    capacity: int
    max_pending_events: int
    frame_bytes: dict[str, int] | None
    stats: CoreStats


@message("fe_shutdown")
@dataclass(frozen=True)
class Shutdown:
    """Stop listening; requests in flight get the drain time, then fail."""

    reason: str


@message("fe_ended")
@dataclass(frozen=True)
class Ended:
    """A request's end: ``reason`` "stop"/"length", or ``error`` (then reason is "")."""

    request_id: int
    reason: str
    stop_token_id: int | None = None
    entry: tuple | None = None
    """Finished.entry as (index, token_id, logprob, alt_ids, alt_values, last, entropy)."""
    error: str | None = None


@message("fe_prompt_rows")
@dataclass(frozen=True)
class PromptRows:
    """One request's scored prompt positions of this step (PromptScores), as arrays."""

    request_id: int
    positions: np.ndarray
    token_ids: np.ndarray
    values: np.ndarray
    ranks: np.ndarray
    alt_counts: np.ndarray
    alt_ids: np.ndarray
    alt_values: np.ndarray


@message("fe_step_outputs")
@dataclass(frozen=True)
class StepOutputs:
    """One step's events for one API server: every generated token as a row of parallel
    arrays (FP32 values exact; NaN: no logprob, which a real value never is), their natural
    or selected alternatives flattened (``alt_counts`` per token), prompt rows, ends."""

    request_ids: np.ndarray
    indexes: np.ndarray
    token_ids: np.ndarray
    values: np.ndarray
    last: np.ndarray
    """int8: -1 unknown (None), 0 False, 1 True (GeneratedToken.last)."""
    alt_counts: np.ndarray
    alt_ids: np.ndarray
    alt_values: np.ndarray
    prompts: tuple[PromptRows, ...]
    ends: tuple[Ended, ...]
    stats: CoreStats
    entropy: np.ndarray | None = None
    """float32 per token (exact FP32; NaN: none), or None when no token of the step has one
    (return_entropy)."""

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if self.entropy is not None and len(self.entropy) != n:
            raise ValueError(f"entropy: {len(self.entropy)} rows, expected {n}")
        for name in ("indexes", "token_ids", "values", "last", "alt_counts"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: {len(getattr(self, name))} rows, expected {n}")
        if len(self.alt_ids) != len(self.alt_values) or len(self.alt_ids) != int(
                self.alt_counts.sum()):
            raise ValueError("alt_ids / alt_values do not match alt_counts")
