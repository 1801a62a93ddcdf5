"""The one serving configuration: every setting and its default, checked once, resolved once.

``launch/`` builds it from the command line (argparse defaults are read from here); the
scheduler and the rank step receive the parts they need, derived below.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from helios_logprobs.kernels.layout import EXPORT_K, LOGPROBS_MODES
from helios_logprobs.runtime.text.reasoning import load_reasoning, reasoning_strings

if TYPE_CHECKING:  # (torch: the command line reads this module's defaults without it)
    from helios_logprobs.ranks.model import ModelConfig
    from helios_logprobs.ranks.step import StepConfig
    from helios_logprobs.runtime.engine.scheduler import SchedulerConfig

BACKENDS = ("torch", "triton")
DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_MODEL_LEN_CAP = 4096


@dataclass(frozen=True)
class RuntimeConfig:
    model_dir: Path
    served_model_name: str | None = None
    """None: the model directory's name."""
    device: str = "cpu"
    capacity: int = 16
    """Physical request slots (the completion bundle's capacity)."""
    max_model_len: int | None = None
    """None: the checkpoint's max_position_embeddings, capped at 4096."""
    chunk_size: int = 256
    """Prefill chunk in tokens."""
    max_batched_tokens: int | None = None
    """Tokens per submission; None: twice the larger of chunk_size and capacity."""
    logprobs: bool = True
    """False exports a core without logprob buffers (K=0): logprob requests get HTTP 400."""
    logprobs_mode: str = LOGPROBS_MODES[0]
    """--logprobs-mode (vLLM's four values): ranks/step/config.py StepConfig.logprobs_mode."""
    max_logprobs: int = EXPORT_K
    """K, natural alternatives the core exports (vLLM's --max-logprobs). K < 20 declares no
    token-ID inputs, so logprob_token_ids is refused."""
    completion_token_capacity: int = 0
    """T, token slots per completion record; 0 means eight."""
    reduction_backend: str = "torch"
    prompt_logprobs: bool = False
    """--prompt-logprobs: allocate the scored-prefill ladder so requests may ask for prompt
    logprobs (completions `prompt_logprobs`, `echo` with `logprobs`). Off: nothing for
    scoring exists and such requests get HTTP 400."""
    max_pending_frames: int = 64
    """Frames of undelivered events (at most T each) a generate() consumer may fall behind
    before the engine aborts its request with "client too slow"; the step thread never
    waits for a consumer and no event is dropped."""
    collective_timeout_s: float = 20.0
    """Seconds before a silent peer fails a collective."""
    heartbeat_timeout_s: float = 5.0
    """Seconds without a heartbeat before a peer (or the coordinator) counts as lost."""
    speculative_tokens: int = 0
    """N: speculative decoding with history proposals (prompt lookup over each request's own
    prompt and output, vLLM's ``ngram`` method); each decode verifies up to N proposed tokens
    in the same forward and emits up to N + 1 tokens. 0 (the default) is off. Needs N + 1 <= T.
    Greedy and seeded requests get the same tokens on and off, and logprobs equal to FP32
    rounding (bit for bit with ``batch_invariant``)."""
    ngram_min: int = 2
    """The shortest suffix n-gram matched against the history for a proposal."""
    ngram_max: int = 4
    """The longest suffix n-gram matched (the longest match wins)."""
    batch_invariant: bool = False
    """--batch-invariant (vLLM's VLLM_BATCH_INVARIANT): every row's logits and logprobs are the
    same bits whatever else shares its forward, so speculation on and off, and one request
    alone or in a busy batch, report identical values (see ranks/model/invariant.py). Off,
    they agree to FP32 rounding (about 1e-5). Costs speed: short batches are padded to 16
    rows, and attention runs in fixed key blocks."""
    reasoning_parser: str | None = None
    """``qwen3`` or ``deepseek_r1``: thinking spans are ``<think>`` ... ``</think>``; enables the
    requests' ``thinking_token_budget``. None: no reasoning delimiters (budgets are refused)."""
    reasoning_config: dict | None = None
    """{"reasoning_start_str": ..., "reasoning_end_str": ...}: the delimiters, overriding the
    parser's (without a parser both are needed)."""
    dtype: str = "auto"
    """--dtype (vLLM's values): weights, activations and KV cache; ``auto`` follows the
    checkpoint on CUDA and is float32 on CPU (ranks/model/dtype.py). Logprobs stay FP32."""

    compile: bool = False
    """--compile / --enforce-eager (vLLM's names): the forward (padded token buckets,
    ranks/step/forward_graph.py) and the reduce phase each run as one graph of
    torch.compile(fullgraph=True), compiled before the server reports ready. Off by default
    on CPU: bench/compile_decode.py measures it (docs/performance.md)."""
    cuda_graphs: bool = True
    """On CUDA, capture the decode step's variants at start-up and replay them (vLLM's default;
    ranks/step/cuda_graphs.py); ``--enforce-eager`` turns it off. Ignored on the CPU."""

    seed: int | None = None
    """--seed (vLLM's): requests without a seed draw theirs from it (scheduler.unset_seed), so
    a run is repeatable; None: fresh draws."""

    def __post_init__(self) -> None:
        positive = ("capacity", "chunk_size", "max_pending_frames", "collective_timeout_s",
                    "heartbeat_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if not 1 <= self.max_logprobs <= EXPORT_K:
            raise ValueError(
                f"max_logprobs must be in [1, {EXPORT_K}], got {self.max_logprobs} "
                "(serve without logprob outputs with logprobs=False / --no-logprobs)"
            )
        if self.completion_token_capacity < 0:
            raise ValueError(
                f"completion_token_capacity must be >= 0, got {self.completion_token_capacity}"
            )
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min="
                             f"{self.ngram_min}, ngram_max={self.ngram_max}")
        from helios_logprobs.ranks.contract.declarations import (
            DEFAULT_COMPLETION_TOKEN_CAPACITY,
        )

        tokens = self.completion_token_capacity or DEFAULT_COMPLETION_TOKEN_CAPACITY
        if self.speculative_tokens >= tokens:
            raise ValueError(
                f"speculative_tokens={self.speculative_tokens} needs "
                f"completion_token_capacity >= {self.speculative_tokens + 1} (a round emits up "
                f"to N + 1 tokens into one record), got T={tokens}"
            )
        reasoning_strings(self.reasoning_parser, self.reasoning_config)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.compile and self.reduction_backend not in ("torch", "triton"):
            raise ValueError(f"compile needs reduction_backend 'torch' or 'triton' (the "
                             f"compiled region's launches), got {self.reduction_backend!r}")
        if self.compile and self.reduction_backend == "triton" and self.device != "cuda":
            raise ValueError("compile with reduction_backend 'triton' needs device 'cuda' "
                             "(Inductor runs Triton kernels on GPU tensors only); the CPU "
                             "compiles the torch backend")
        if self.reduction_backend not in BACKENDS:
            raise ValueError(f"reduction_backend must be one of {BACKENDS}, "
                             f"got {self.reduction_backend!r}")

    @classmethod
    def default(cls, name: str) -> object:
        """A field's default (the command line shows the same values)."""
        return next(f.default for f in fields(cls) if f.name == name)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    def resolve_max_model_len(self, model: ModelConfig) -> int:
        """The explicit --max-model-len, else the checkpoint's max_position_embeddings capped
        at 4096 and at a sliding window (which is served only where it never binds)."""
        window = model.sliding_window
        if self.max_model_len is not None and window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the checkpoint's "
                             f"sliding_window {window}; sliding-window attention is not "
                             f"implemented, so at most {window} tokens are served")
        limits = (model.max_position_embeddings, MAX_MODEL_LEN_CAP, window)
        return self.max_model_len or min(n for n in limits if n is not None)

    def step_config(self, max_seq_len: int) -> StepConfig:
        from helios_logprobs.ranks.step import StepConfig

        return StepConfig(
            capacity=self.capacity,
            max_seq_len=max_seq_len,
            token_capacity=self.completion_token_capacity,
            reduction_backend=self.reduction_backend,
            max_logprobs=self.max_logprobs if self.logprobs else 0,
            prompt_logprobs=self.prompt_logprobs,
            logprobs_mode=self.logprobs_mode,
            chunk_limit=self.chunk_size,
            speculative_tokens=self.speculative_tokens,
            max_batched_tokens=self.batched_tokens,
            compile=self.compile,
            cuda_graphs=self.cuda_graphs,
        )

    @property
    def batched_tokens(self) -> int:
        """Tokens per submission: the explicit value, else twice the larger of chunk_size and
        capacity x (1 + N)."""
        return self.max_batched_tokens or 2 * max(
            self.chunk_size, self.capacity * (1 + self.speculative_tokens)
        )

    def scheduler_config(self, max_seq_len: int) -> SchedulerConfig:
        """The coordinator's planning settings; resolves the reasoning delimiters' token ids
        with the model's tokenizer."""
        from helios_logprobs.runtime.engine.scheduler import SchedulerConfig

        batched = self.batched_tokens
        return SchedulerConfig(
            self.capacity, max_seq_len, self.chunk_size, batched,
            speculative_tokens=self.speculative_tokens,
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            reasoning=load_reasoning(self.reasoning_parser, self.reasoning_config,
                                     self.model_dir),
            seed=self.seed,
        )
