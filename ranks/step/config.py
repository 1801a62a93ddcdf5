"""What a rank step is built for: capacity, sequence length, T, K and the reduction backend."""

from __future__ import annotations

from dataclasses import dataclass

from helios_logprobs.kernels.layout import EXPORT_K, LOGPROBS_MODES
from helios_logprobs.ranks.contract.declarations import resolve_completion_token_capacity


@dataclass(frozen=True)
class StepConfig:
    capacity: int
    max_seq_len: int
    token_capacity: int = 8
    """T, token slots per completion record; 0 means eight."""
    reduction_backend: str = "torch"
    max_logprobs: int = EXPORT_K
    """K of the core's logprob outputs: 20 declares the complete bundle with the ID inputs,
    1..19 the natural-only layout (completion_logprobs [2, capacity, T, 2+2K], no ID inputs),
    0 no logprob outputs at all (no uploader, no reduction)."""
    prompt_logprobs: bool = False
    """--prompt-logprobs: allocate the scored-prefill ladder (capacities up to chunk_limit)."""
    chunk_limit: int = 256
    """The largest prefill chunk the coordinator plans (the largest scored capacity)."""
    speculative_tokens: int = 0
    """N, the most proposals a speculative round verifies (0: no rounds); a round emits at
    most N + 1 tokens, so N + 1 <= T."""
    max_batched_tokens: int = 0
    """Tokens of one submission (the scheduler's budget): the static input buffers' length.
    0: the scheduler's default, twice the larger of chunk_limit and max_rows."""

    compile: bool = False
    """--compile: the forward (ranks/step/forward_graph.py; eager under batch_invariant), the
    sample phase (ranks/step/sample_graph.py), prompt scoring (ranks/step/scoring.py) and the
    reduce phase (ranks/step/reduce_graph.py) run as ``torch.compile(fullgraph=True)``
    graphs, compiled at start-up; the reduction's launches are the torch backend's ops or the
    Triton backend's triton_ops (CUDA)."""

    cuda_graphs: bool = False
    """On CUDA: capture the decode step's variants after warm-up and replay them for decode
    submissions (ranks/step/cuda_graphs.py); ignored on the CPU. Off: every phase eager."""

    logprobs_mode: str = LOGPROBS_MODES[0]
    """--logprobs-mode: what generated positions report. raw_*: the logits the sampler
    receives; processed_*: after every processor, temperature and the top-k/top-p/min-p mask
    (a dropped token at -inf), renormalized over the kept tokens for processed_logprobs;
    *_logits: the values themselves, no normalization (ranks/step/reduce.py)."""

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{self.logprobs_mode!r}")
        if self.compile and self.logprobs_mode.endswith("_logits"):
            raise ValueError(f"compile serves the *_logprobs modes only, got "
                             f"{self.logprobs_mode!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not 0 <= self.max_logprobs <= EXPORT_K:
            raise ValueError(f"max_logprobs must be in [0, {EXPORT_K}], got {self.max_logprobs}")
        if self.prompt_logprobs and self.max_logprobs != EXPORT_K:
            raise ValueError(f"prompt scoring requires K={EXPORT_K} generation logprob outputs, "
                             f"got max_logprobs={self.max_logprobs}")
        if self.compile and self.reduction_backend not in ("torch", "triton"):
            raise ValueError(f"compile needs the torch or triton reduction backend, got "
                             f"{self.reduction_backend!r}")
        if self.chunk_limit < 1:
            raise ValueError(f"chunk_limit must be >= 1, got {self.chunk_limit}")
        if self.max_batched_tokens < 0:
            raise ValueError(f"max_batched_tokens must be >= 0, got {self.max_batched_tokens}")
        tokens = resolve_completion_token_capacity(self.token_capacity)
        if not 0 <= self.speculative_tokens < tokens:
            raise ValueError(
                f"speculative_tokens must be in [0, T - 1 = {tokens - 1}] (a round emits up "
                f"to N + 1 tokens into one record), got {self.speculative_tokens}"
            )

    @property
    def max_rows(self) -> int:
        """Sampling rows of one submission: capacity x (1 + N)."""
        return self.capacity * (1 + self.speculative_tokens)

    @property
    def token_budget(self) -> int:
        """The most tokens one submission feeds the forward (its input buffers' length)."""
        return self.max_batched_tokens or 2 * max(self.chunk_limit, self.max_rows)

    @property
    def processed(self) -> bool:
        """Whether generated positions report the sampler's processed rows."""
        return self.logprobs_mode.startswith("processed_")

    @property
    def normalized(self) -> bool:
        """Whether generated positions report logprobs (else the logits themselves)."""
        return self.logprobs_mode.endswith("_logprobs")

    @property
    def logprobs(self) -> bool:
        """Whether the core declares logprob outputs."""
        return self.max_logprobs > 0
