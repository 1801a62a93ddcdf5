"""CUDA graphs of the decode step: variants captured after warm-up, one shared graph pool.

What is captured, and when it replays:

- Decode submissions only (vLLM's "uniform decode": every work item feeds one token and
  samples, no speculative proposals, no scored chunk, no grammar masks, no entropy). Prefill,
  mixed, scored and speculative submissions stay eager.
- The reduce phase: one variant per device frame (0, 1), over all ``max_rows`` rows of the
  static row buffers (ranks/step/inputs.py StepBuffers). Rows past the submission's last hold
  slot -1 and fail the gate inside the tensors (no host branch decides which rows run), and
  the payload write goes through a row map (``captured_reduce``), so a padded row never
  writes and two rows never race for one position. The gate, the driver's launches and
  exchanges, and the write all read fixed addresses: the graph replays them as captured.
- The decode forward (and, once the sampler's plan tensors are static, the sample phase):
  one variant per batch bucket (``capture_sizes``: vLLM's 1, 2, 4, then multiples of 8) over
  the same static buffers, rows past the batch padded (``pad_decode_inputs``: slot
  ``PAD_SLOT``, position 0, token 0, as vLLM's _PAD_SLOT_ID). This needs a forward whose
  attention reads no host list (the eager one sizes its mask from the longest context on the
  host and builds index tensors from host data, which a graph cannot replay): the hook is
  ``DecodeGraphs(decode_forward=...)``, a factory ``bucket -> callable`` that the compiled
  decode forward (ranks/step/forward_graph.py, in progress) provides. Without it only the
  reduce phase is captured and the forward and sample stay eager.

Every variant is captured into one pool (``torch.cuda.graph_pool_handle()``), largest first
as vLLM does, so a smaller variant reuses the larger one's blocks; each is warmed up on a
side stream before its capture (first launches compile, allocate workspaces and pick
cuBLAS/Triton configurations outside the graph). Capture is CUDA-only and off unless the
step's config asks for it (``StepConfig.cuda_graphs``); the CPU never builds a
``DecodeGraphs``. The bookkeeping (buckets, padding, eligibility, capture order and pool
sharing) is device-independent and takes a ``GraphBackend``, so the CPU tests drive it with a
backend that replays the captured callables (tests/unit/ranks/test_cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from helios_logprobs.ranks.contract.abi6 import HEADER
from helios_logprobs.ranks.plan import StepPlan

PAD_SLOT = -1
"""The slot of a padding row (vLLM's _PAD_SLOT_ID): its cache write is skipped, and its
sampling row fails the reduction's gate."""
DEFAULT_MAX_CAPTURE = 512
"""vLLM's ceiling on captured batch sizes."""
WARMUP_CALLS = 2
"""Eager calls of each variant on the capture stream before its capture."""

REDUCE = "reduce"
DECODE = "decode"


def capture_sizes(max_rows: int, limit: int = DEFAULT_MAX_CAPTURE) -> tuple[int, ...]:
    """vLLM's decode buckets up to ``max_rows`` (1, 2, 4, multiples of 8 below 256, then of
    16), with ``max_rows`` itself last when it is not one of them (the largest decode batch
    must have a bucket). Ascending."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    top = min(max_rows, limit)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    out = [s for s in sizes if s <= top]
    if out[-1] != top:
        out.append(top)
    return tuple(out)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows; None when none does (the step runs eager)."""
    if rows < 1:
        return None
    for size in sizes:
        if size >= rows:
            return size
    return None


def decode_rows(plan: StepPlan) -> int:
    """The sampling rows of a uniform decode submission (every work item one token that
    samples, no proposals, targets or grammar masks; no scored chunk; no entropy), or 0 for
    any other submission (it runs eager)."""
    if plan.entropy or not plan.work:
        return 0
    for work in plan.work:
        if (len(work.tokens) != 1 or not work.samples or work.proposals or work.targets
                or work.grammar_masks):
            return 0
    return len(plan.work)


@dataclass(frozen=True)
class PaddedBatch:
    """A decode batch of ``rows`` rows run as bucket ``bucket``: buffer entries
    [rows, bucket) of the token, position, slot and forward-row inputs are padding."""

    rows: int
    bucket: int

    def __post_init__(self) -> None:
        if not 1 <= self.rows <= self.bucket:
            raise ValueError(f"rows must be in [1, bucket={self.bucket}], got {self.rows}")

    @property
    def padding(self) -> slice:
        return slice(self.rows, self.bucket)


def pad_decode_inputs(buffers, batch: PaddedBatch, rows: torch.Tensor) -> None:
    """Write the padding rows of a decode batch into the step's static inputs (device
    fills and one copy from ``rows``, a static arange: no allocation): token 0, position 0,
    slot PAD_SLOT, forward row = the row itself (token r is row r's last token in a decode
    batch, so each padding row projects its own hidden state). prepare uploaded the real
    rows."""
    pad = batch.padding
    if pad.start == pad.stop:
        return
    buffers.token_ids[pad].fill_(0)
    buffers.positions[pad].fill_(0)
    buffers.slots[pad].fill_(PAD_SLOT)
    buffers.row_index[pad].copy_(rows[pad])


@dataclass(frozen=True)
class GraphKey:
    """One captured variant: its phase, its rows (a bucket; max_rows for the reduce phase)
    and, for the reduce phase, the device frame its records and payload are."""

    phase: str
    rows: int
    frame: int = 0

    def __post_init__(self) -> None:
        if self.phase not in (REDUCE, DECODE):
            raise ValueError(f"phase must be {REDUCE!r} or {DECODE!r}, got {self.phase!r}")
        if self.rows < 1 or self.frame not in (0, 1):
            raise ValueError(f"rows >= 1 and frame in (0, 1), got {self.rows}, {self.frame}")


def capture_order(keys) -> list[GraphKey]:
    """Largest rows first (a smaller graph reuses the larger one's pool blocks), the forward
    before the reduce phase at equal rows, frame 0 before 1."""
    return sorted(keys, key=lambda k: (-k.rows, k.phase != DECODE, k.frame))


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """What captures: ``pool()`` once per DecodeGraphs, ``capture(fn, pool)`` per variant."""

    def pool(self) -> object: ...

    def capture(self, fn: Callable[[], None], pool: object) -> Replayable: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture: ``WARMUP_CALLS`` eager calls on a side stream, then the
    capture on that stream into the shared pool."""

    def __init__(self, device: torch.device, warmup: int = WARMUP_CALLS) -> None:
        self.device = torch.device(device)
        self.warmup = warmup
        self.stream = torch.cuda.Stream(self.device)

    def pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool: object) -> Replayable:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup):
                fn()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            fn()
        return graph


@dataclass
class GraphCounters:
    captured: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {REDUCE: 0, DECODE: 0})
    eager: int = 0
    """Submissions with sampling rows that ran every phase eager."""


class GraphSet:
    """Variants captured once, in ``capture_order``, all into one pool; replayed by key."""

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.pool = backend.pool()
        """The one pool every variant captures into."""
        self.graphs: dict[GraphKey, Replayable] = {}
        self.counters = GraphCounters()

    def capture(self, variants: dict[GraphKey, Callable[[], None]]) -> None:
        for key in capture_order(variants):
            if key in self.graphs:
                raise ValueError(f"{key} is captured already")
            self.graphs[key] = self.backend.capture(variants[key], self.pool)
            self.counters.captured += 1

    def replay(self, key: GraphKey) -> None:
        self.graphs[key].replay()
        self.counters.replays[key.phase] += 1


def captured_reduce(reduction, frame: int, row_tensors: torch.Tensor) -> None:
    """The reduce phase over every buffer row, capture-safe: the step reduction's tensor gate
    (rows with slot -1 fail it), its driver (zero flags skip rows inside the launches), and a
    payload write through a row map: each (slot, position) of ``frame`` takes the highest
    gated row that targets it, or keeps its words. Equal to the eager phase's write for a
    well-formed submission (one row per position), and padded rows write nothing."""
    slots, epochs, positions = row_tensors.unbind(0)
    reduction.gate(frame, slots, epochs, positions)
    reduction.driver(reduction.logits, reduction.request, reduction.out)
    payload = reduction.outputs.completion_logprobs[frame]
    capacity, tokens, words = payload.shape
    target_rows = payload.view(capacity * tokens, words)
    gated = reduction.requested != 0
    clamped = positions.clamp(min=0, max=reduction.outputs.completion_records.shape[-1]
                              - HEADER - 1)
    target = torch.where(gated, slots.clamp(min=0) * tokens + clamped, 0)
    source = torch.where(gated, reduction.rows, -1)
    row_of = torch.full((capacity * tokens,), -1, dtype=torch.int64, device=slots.device)
    row_of = row_of.scatter_reduce(0, target, source, "amax")
    packed = reduction.out.index_select(0, row_of.clamp(min=0))[:, :words]
    target_rows.copy_(torch.where((row_of >= 0).unsqueeze(1), packed, target_rows))


class DecodeGraphs:
    """The captured decode step of one RankStep: the reduce phase per frame, and with a
    ``decode_forward`` factory the forward per bucket. ``reduce(inputs)`` and
    ``forward(inputs)`` replay for decode submissions and return True, or return False and
    the step runs that phase eagerly."""

    def __init__(self, step, backend: GraphBackend,
                 decode_forward: Callable[[int], Callable[[], None]] | None = None,
                 max_capture: int = DEFAULT_MAX_CAPTURE) -> None:
        if step.reduction is None and decode_forward is None:
            raise ValueError("nothing to capture: no reduction and no decode forward")
        self.step = step
        self.buffers = step.buffers
        self.max_rows = step.config.max_rows
        self.sizes = capture_sizes(step.config.capacity, max_capture)
        self.rows = None if decode_forward is None else torch.arange(
            self.sizes[-1], dtype=torch.int64, device=step.device)
        """Static 0..largest bucket: the forward rows of padding (pad_decode_inputs)."""
        self.graphs = GraphSet(backend)
        variants: dict[GraphKey, Callable[[], None]] = {}
        if step.reduction is not None:
            for frame in (0, 1):
                variants[GraphKey(REDUCE, self.max_rows, frame)] = _bind(
                    captured_reduce, step.reduction, frame, self.buffers.row_tensors)
        self.captures_forward = decode_forward is not None
        if decode_forward is not None:
            for size in self.sizes:
                variants[GraphKey(DECODE, size)] = decode_forward(size)
        self.graphs.capture(variants)

    @property
    def counters(self) -> GraphCounters:
        return self.graphs.counters

    def batch(self, inputs) -> PaddedBatch | None:
        """The padded decode batch of a submission, or None (it runs eager)."""
        rows = decode_rows(inputs.plan)
        bucket = bucket_for(rows, self.sizes)
        return None if bucket is None else PaddedBatch(rows, bucket)

    def forward(self, inputs) -> bool:
        """Replay the bucket's forward (the hook's variant) for a decode submission."""
        batch = self.batch(inputs) if self.captures_forward else None
        if batch is None:
            return False
        pad_decode_inputs(self.buffers, batch, self.rows)
        self.graphs.replay(GraphKey(DECODE, batch.bucket))
        return True

    def reduce(self, inputs) -> bool:
        """Replay the frame's reduce variant for a decode submission."""
        if self.step.reduction is None or self.batch(inputs) is None:
            self.counters.eager += 1
            return False
        self.graphs.replay(GraphKey(REDUCE, self.max_rows, inputs.frame))
        return True


def _bind(fn, *args) -> Callable[[], None]:
    def variant() -> None:
        fn(*args)

    return variant


def enable_decode_graphs(step) -> DecodeGraphs | None:
    """Turn capture on for a built step (what ``cuda_graphs=True`` at construction does):
    for benchmarks and tests that build the step through the runtime's config."""
    step.config = replace(step.config, cuda_graphs=True)
    step.cuda_graphs = decode_graphs(step)
    return step.cuda_graphs


def decode_graphs(step) -> DecodeGraphs | None:
    """The step's captured decode variants: on CUDA with ``StepConfig.cuda_graphs``, else
    None (the CPU, or --enforce-eager: every phase eager)."""
    if not getattr(step.config, "cuda_graphs", False) or step.device.type != "cuda":
        return None
    if step.reduction is None:
        return None  # (no forward variant yet: nothing to capture without a reduction)
    return DecodeGraphs(step, CudaGraphBackend(step.device))
