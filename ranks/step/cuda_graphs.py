"""CUDA graphs of the decode step: variants captured after warm-up, one shared graph pool.

What is captured, and when it replays:

- Decode submissions only (vLLM's "uniform decode": every work item feeds one token and
  samples, no speculative proposals, no scored chunk, no grammar masks, no entropy;
  ``decode_rows``). Prefill, mixed, scored and speculative submissions stay eager (or
  compiled, uncaptured).
- The reduce phase over all ``max_rows`` rows of the static row buffers (ranks/step/inputs.py
  StepBuffers). Rows past the submission's last hold slot -1 and fail the gate inside the
  tensors (no host branch decides which rows run). With --compile it is the compiled region
  (ranks/step/reduce_graph.py: the frame is a tensor, one variant); otherwise the step
  reduction's gate and launches with a payload write through a row map
  (``captured_reduce``: a padded row never writes, two rows never race for a position), one
  variant per device frame.
- With --compile, the decode forward and the projection into the reduction's logit rows, one
  variant per decode bucket of the compiled forward's ladder (ranks/step/forward_graph.py:
  its static buffers, its padding to the spare cache slot, ``load`` before the replay), the
  key length pinned at max_seq_len (the mask alone bounds each row's context).
  ``CapturedForward``.

The sample phase is not captured yet: the readback and the host commit sit between it and
the reduction, and a captured sampler needs each bucket's plan tensors at fixed addresses
(ranks/sampler's static pools give fixed storage, but a plan's views start where its
reservations fall, which depends on the rows' processors). The next variant to add.

Every variant is captured into one pool (``torch.cuda.graph_pool_handle()``), largest first
as vLLM does, so a smaller variant reuses the larger one's blocks; each is warmed up on a
side stream before its capture (first launches allocate workspaces and pick cuBLAS/Triton
configurations outside the graph). Capture is CUDA-only and off unless the step's config
asks for it (``StepConfig.cuda_graphs``); the CPU never builds one by itself. The
bookkeeping (eligibility, capture order, pool sharing, which variant replays) is
device-independent and takes a ``GraphBackend``, so the CPU tests drive it with a backend
that replays the captured callables under a strict host-sync guard
(tests/unit/ranks/test_cuda_graphs.py); tests/gpu/test_cuda_graphs_gpu.py replays real
graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from helios_logprobs.ranks.contract.abi6 import HEADER
from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.ranks.step.reduce_graph import compile_counters

WARMUP_CALLS = 2
"""Eager calls of each variant on the capture stream before its capture."""

REDUCE = "reduce"
DECODE = "decode"


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
    """Submissions whose reduce phase ran uncaptured (not a decode submission)."""


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


class CapturedForward:
    """The compiled decode forward (``step.forward_graph``) and the projection of its rows,
    per decode bucket of its ladder (the buckets up to the first that holds ``capacity``
    rows). Each variant projects into the reduction's logit buffer (the raw modes) or into a
    tensor of the graph's pool, kept in ``logits``."""

    def __init__(self, step) -> None:
        graph = step.forward_graph
        if graph is None:
            raise ValueError("the captured forward needs the compiled forward (--compile)")
        self.step, self.graph = step, graph
        capacity = step.config.capacity
        top = next(b for b in graph.buckets if b >= capacity)
        self.sizes = tuple(b for b in graph.buckets if b <= top)
        self.logits: dict[int, torch.Tensor] = {}
        """Bucket -> its projected rows [min(bucket, max_rows), local_width] (static)."""

    def variant(self, size: int) -> Callable[[], None]:
        step, graph = self.step, self.graph
        variant = graph.variants[size]
        rows = min(size, step.config.max_rows)
        reduction = step.reduction
        out = reduction.logits[:rows] if reduction is not None and reduction.reads_raw \
            else None

        def run() -> None:
            variant.key_length = graph.max_seq_len  # (what the capture pins)
            hidden = variant.run()
            self.logits[size] = step.model.project(hidden[:rows], out=out)

        return run

    def load(self, inputs, size: int) -> None:
        """The host checks of the batch and the copy of its inputs into the variant's
        buffers, padding to the spare slot (ForwardGraph.load): before the replay."""
        self.step.model.check_batch(inputs.token_ids, inputs.positions, inputs.slots,
                                    inputs.row_index, inputs.host)
        self.graph.load(self.graph.variants[size], inputs.token_ids, inputs.positions,
                        inputs.slots)


class DecodeGraphs:
    """The captured decode step of one RankStep: the reduce phase, and with the compiled
    forward the forward per bucket. ``forward(inputs)`` returns the logit rows of a replayed
    decode forward (else None) and ``reduce(inputs)`` True once it replayed the reduce phase
    (else False): the step runs that phase as it would without graphs."""

    def __init__(self, step, backend: GraphBackend) -> None:
        self.step = step
        self.buffers = step.buffers
        self.max_rows = step.config.max_rows
        self.graphs = GraphSet(backend)
        self.reduce_frames: tuple[int, ...] = ()
        """The frames with their own reduce variant ((0,) with --compile: the frame is a
        tensor of the compiled region)."""
        self.forward_capture = None if step.forward_graph is None else CapturedForward(step)
        variants: dict[GraphKey, Callable[[], None]] = {}
        if step.reduction is not None:
            compiled = step.graph
            self.reduce_frames = (0,) if compiled is not None else (0, 1)
            for frame in self.reduce_frames:
                variants[GraphKey(REDUCE, self.max_rows, frame)] = _bind(
                    compiled, self.buffers.row_tensors, self.buffers.frame_index
                ) if compiled is not None else _bind(
                    captured_reduce, step.reduction, frame, self.buffers.row_tensors)
        if self.forward_capture is not None:
            for size in self.forward_capture.sizes:
                variants[GraphKey(DECODE, size)] = self.forward_capture.variant(size)
        if not variants:
            raise ValueError("nothing to capture: no reduction and no compiled forward")
        self.graphs.capture(variants)

    @property
    def counters(self) -> GraphCounters:
        return self.graphs.counters

    def forward(self, inputs, variant) -> torch.Tensor | None:
        """Replay the bucket of prepare's compiled ``variant`` for a decode submission: its
        sampling rows' logits; None (the step's own forward) otherwise."""
        capture = self.forward_capture
        rows = decode_rows(inputs.plan)
        if capture is None or variant is None or not rows or variant.tokens not in \
                capture.sizes:
            return None
        capture.load(inputs, variant.tokens)
        self.graphs.replay(GraphKey(DECODE, variant.tokens))
        return capture.logits[variant.tokens][:rows]

    def reduce(self, inputs) -> bool:
        """Replay the reduce variant for a decode submission."""
        if not self.reduce_frames or not decode_rows(inputs.plan):
            self.counters.eager += 1
            return False
        frame = inputs.frame if len(self.reduce_frames) == 2 else 0
        self.graphs.replay(GraphKey(REDUCE, self.max_rows, frame))
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
    step.compiled_at_start = compile_counters()  # (a capture is start-up work, as in __init__)
    return step.cuda_graphs


def decode_graphs(step) -> DecodeGraphs | None:
    """The step's captured decode variants: on CUDA with ``StepConfig.cuda_graphs``, else
    None (the CPU, or --enforce-eager: every phase eager)."""
    if not getattr(step.config, "cuda_graphs", False) or step.device.type != "cuda":
        return None
    if step.reduction is None and step.forward_graph is None:
        return None  # (nothing to capture)
    try:
        return DecodeGraphs(step, CudaGraphBackend(step.device))
    except RuntimeError as error:  # (a capture CUDA refuses: serve eagerly, say so once)
        logging.getLogger(__name__).warning(
            "CUDA graph capture failed (%s); every phase runs eagerly (--enforce-eager "
            "silences this)", error)
        return None
