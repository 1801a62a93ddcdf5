"""Memory accounting of one rank, computed from the configuration alone: the one place that
knows what every buffer of a rank (and the coordinator's host frames) costs.

Nothing here allocates a tensor or reads a weight: ``rank_sizing`` takes the checkpoint's
``ModelConfig``, the ``StepConfig`` a rank is built for, the tensor-parallel size and the
logit dtype, and lists every buffer the rank holds once ``RankStep`` is constructed, with the
attribute path where the live rank keeps it (``model.weights.layers[*].qkv``,
``reduction.driver.exchange2.recv``, ...). tests/unit/ranks/test_capacity.py and
tests/distributed/test_capacity_tp.py build real ranks and compare these entries, buffer by
buffer and in total, with the tensors those paths hold; a buffer added to the code but not
here fails them. ``ranks/capacity/buffers.py`` lists the buffers, this module adds them up;
``launch/capacity.py`` prints the result; ``frame_bytes`` gives a live
server the bytes of its completion and scored frames.

Transient tensors (activations of a forward, the per-call temporaries of the torch reduction
and the sampler's filters) are not buffers: they come and go within a step and are what the
memory-utilization margin is for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from helios_logprobs.ranks.capacity.buffers import (
    FIXED_SECTIONS,
    WEIGHT_KINDS,
    Buffer,
    completion_buffers,
    dtype_name,
    host_buffers,
    input_buffers,
    kv_bytes_per_token,
    kv_cache_buffers,
    reduction_buffers,
    sampler_buffers,
    scored_frame_buffers,
    scoring_buffers,
    weight_buffers,
)
from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.sharding import ShardLayout, shard_layout
from helios_logprobs.ranks.step.config import StepConfig


@dataclass(frozen=True)
class RankSizing:
    rank: int
    layout: ShardLayout
    buffers: tuple[Buffer, ...]
    """Weights and fixed buffers, without the KV cache."""
    kv_cache: tuple[Buffer, ...]
    """The cache the configured capacity x max_seq_len allocates."""
    kv_bytes_per_token: int
    host: tuple[Buffer, ...] = ()
    """The coordinator's (rank 0's) host frames; empty on other ranks."""

    def section(self, name: str) -> tuple[Buffer, ...]:
        if name == "kv_cache":
            return self.kv_cache
        if name == "host":
            return self.host
        return tuple(b for b in self.buffers if b.section == name)

    def section_bytes(self, name: str) -> int:
        """The section's bytes in its own memory (a buffer with ``memory`` set is elsewhere:
        pinned_bytes, staging_bytes)."""
        return sum(b.nbytes for b in self.section(name) if not b.memory)

    @property
    def weight_bytes(self) -> int:
        return self.section_bytes("weights")

    @property
    def fixed_bytes(self) -> int:
        """Every device buffer besides weights and KV cache."""
        return sum(self.section_bytes(s) for s in FIXED_SECTIONS)

    @property
    def pinned_bytes(self) -> int:
        """The rank's page-locked host buffers (CUDA: the step inputs' upload twin)."""
        return sum(b.nbytes for b in self.buffers if b.memory == "pinned")

    @property
    def staging_bytes(self) -> int:
        """Device buffers of the coordinator's host section (CUDA: the copy staging frame),
        rank 0 only; counted in ``device_bytes``, not in ``host_bytes``."""
        return sum(b.nbytes for b in self.host if b.memory == "device")

    @property
    def kv_cache_bytes(self) -> int:
        return sum(b.nbytes for b in self.kv_cache)

    @property
    def device_bytes(self) -> int:
        """Everything the constructed RankStep (and on rank 0 the coordinator's executor)
        holds on its device."""
        return self.weight_bytes + self.fixed_bytes + self.kv_cache_bytes + self.staging_bytes

    @property
    def host_bytes(self) -> int:
        return self.section_bytes("host")

    def weight_kind_bytes(self) -> dict[str, int]:
        out = dict.fromkeys(WEIGHT_KINDS, 0)
        for b in self.section("weights"):
            out[b.kind] += b.nbytes
        return out


def rank_sizing(
    config: ModelConfig,
    step: StepConfig,
    world: int,
    rank: int,
    dtype: object,
    interpreted: bool = False,
    cuda: bool = False,
) -> RankSizing:
    """What rank ``rank`` of a ``world``-rank job built with ``step`` holds; ``dtype`` is the
    model's (logit) dtype, ``interpreted`` the Triton interpreter's tile geometry (CPU),
    ``cuda`` adds CUDA's own buffers (the inputs' pinned twin, the copy staging frame)."""
    dt = dtype_name(dtype)
    layout = shard_layout(config, world, rank)
    buffers = (
        *weight_buffers(config, layout, dt),
        *input_buffers(step, cuda),
        *completion_buffers(step),
        *sampler_buffers(step, layout, cuda),
        *reduction_buffers(step, config, layout, dt, interpreted),
        *scoring_buffers(step, layout, dt),
    )
    return RankSizing(
        rank=rank,
        layout=layout,
        buffers=buffers,
        kv_cache=kv_cache_buffers(config, layout, dt, step.capacity, step.max_seq_len),
        kv_bytes_per_token=kv_bytes_per_token(config, layout, dt),
        host=host_buffers(step, cuda) if rank == 0 else (),
    )


@dataclass(frozen=True)
class RankBudget:
    """What is left of one rank's usable memory for the KV cache."""

    rank: int
    usable: int
    weights: int
    fixed: int
    host: int
    """Host frames charged to this budget (rank 0 on CPU, where host and device are one)."""
    remaining: int
    """usable - weights - fixed - host; negative when they do not fit."""
    kv_tokens: int
    kv_sequences: int


@dataclass(frozen=True)
class JobSizing:
    """Every rank of a job against one per-rank budget."""

    step: StepConfig
    ranks: tuple[RankSizing, ...]
    usable: int
    """Per rank: floor(device memory x utilization)."""
    host_in_budget: bool = False
    budgets: tuple[RankBudget, ...] = field(init=False)

    def __post_init__(self) -> None:
        budgets = []
        for r in self.ranks:
            # (CUDA's staging frame is device memory of rank 0 whatever the host frames are)
            host = (r.host_bytes if self.host_in_budget else 0) + r.staging_bytes
            remaining = self.usable - r.weight_bytes - r.fixed_bytes - host
            tokens = max(remaining, 0) // r.kv_bytes_per_token
            budgets.append(RankBudget(r.rank, self.usable, r.weight_bytes, r.fixed_bytes, host,
                                      remaining, tokens, tokens // self.step.max_seq_len))
        object.__setattr__(self, "budgets", tuple(budgets))

    @property
    def shortfall(self) -> int:
        """Bytes the tightest rank lacks for its weights and fixed buffers (0 when they fit)."""
        return max(0, max(-b.remaining for b in self.budgets))

    @property
    def tightest(self) -> RankBudget:
        return min(self.budgets, key=lambda b: (b.remaining, b.rank))

    @property
    def kv_tokens(self) -> int:
        """Every rank holds the same tokens, so the job holds what its tightest rank holds."""
        return min(b.kv_tokens for b in self.budgets)

    @property
    def kv_sequences(self) -> int:
        return self.kv_tokens // self.step.max_seq_len

    @property
    def configured_kv_tokens(self) -> int:
        return self.step.capacity * self.step.max_seq_len

    @property
    def configured_fits(self) -> bool:
        return self.kv_tokens >= self.configured_kv_tokens


def job_sizing(
    config: ModelConfig,
    step: StepConfig,
    world: int,
    dtype: object,
    usable: int,
    interpreted: bool = False,
    host_in_budget: bool = False,
    cuda: bool = False,
) -> JobSizing:
    ranks = tuple(rank_sizing(config, step, world, r, dtype, interpreted, cuda)
                  for r in range(world))
    return JobSizing(step, ranks, usable, host_in_budget)


def max_capacity(
    config: ModelConfig,
    step: StepConfig,
    world: int,
    dtype: object,
    usable: int,
    interpreted: bool = False,
    host_in_budget: bool = False,
    cuda: bool = False,
) -> int:
    """The largest capacity whose buffers and full-length KV cache fit every rank (0: none).
    Every capacity-dependent buffer (bundle, sampler, reduction, host frames) is recounted."""

    def fits(capacity: int) -> bool:
        job = job_sizing(config, replace(step, capacity=capacity), world, dtype, usable,
                         interpreted, host_in_budget, cuda)
        return job.shortfall == 0 and job.configured_fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ------------------------------------------------------------------------------------------
# For a live server
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrameBytes:
    """Physical bytes of the frames a rank step holds (the contract's memory report counts
    them apart from the allocator's totals)."""

    completion: int
    """Device: the CompletionOutputs bundle, both frames (records, packed payload, flags,
    ids, counts)."""
    scored: int
    """Device: every scored capacity's prompt_logprobs frames and prompt_target_tokens (0
    without --prompt-logprobs)."""
    host: int
    """The coordinator's host frames (pinned on CUDA): records, payload, prompt rows."""

    @property
    def device(self) -> int:
        return self.completion + self.scored

    def as_dict(self) -> dict[str, int]:
        return {"completion": self.completion, "scored": self.scored, "device": self.device,
                "host": self.host}


def frame_bytes(step: StepConfig) -> FrameBytes:
    """The frame bytes of a rank built with ``step`` (``RankStep.config``): the same on every
    rank, except ``host``, which only the coordinator holds."""
    return FrameBytes(
        completion=sum(b.nbytes for b in completion_buffers(step)),
        scored=sum(b.nbytes for b in scored_frame_buffers(step)),
        host=sum(b.nbytes for b in host_buffers(step)),
    )
