"""Every buffer one rank holds, from the configuration alone (no tensor, no weight read):
weights by kind, the completion bundle, sampler and reduction workspaces, prompt scoring, the
KV cache and the coordinator's host frames. Each ``Buffer`` names the attribute path where a
live rank keeps it; ``ranks/capacity/sizing.py`` adds them up per rank and per job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helios_logprobs.kernels.layout import (
    EXCHANGE1_WORDS,
    EXCHANGE2_WORDS,
    EXPORT_K,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
    PROMPT_BLOCK_ROWS,
    PROMPT_EXCHANGE_WORDS,
    PROMPT_ROW_WORDS,
    TILE_CANDIDATES,
)
from helios_logprobs.ranks.contract.abi6 import Kind, record_width
from helios_logprobs.ranks.contract.declarations import (
    COMPLETION_LOGPROBS,
    COMPLETION_RECORDS,
    FRAMES,
    LOGPROB_REQUESTED,
    LOGPROB_TOKEN_ID_COUNTS,
    LOGPROB_TOKEN_IDS,
    PROMPT_LOGPROBS,
    PROMPT_TARGET_TOKENS,
    resolve_completion_token_capacity,
)
from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.sharding import ShardLayout
from helios_logprobs.ranks.sampler.buffers import CELLS_PER_ROW as PLAN_CELLS_PER_ROW
from helios_logprobs.ranks.sampler.filters import FILTER_WORDS, PICK_WORDS
from helios_logprobs.ranks.step.config import StepConfig
from helios_logprobs.ranks.step.scoring import scored_capacities

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8,
               "float64": 8, "bool": 1}
DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}

SECTIONS = ("weights", "inputs", "completion", "sampler", "reduction", "scoring", "kv_cache")
"""Device sections in report order; ``host`` (the coordinator's frames) is reported apart."""
FIXED_SECTIONS = ("inputs", "completion", "sampler", "reduction", "scoring")
GATED_KINDS = (Kind.SAMPLE, Kind.SPECULATIVE)
"""The record kinds StepReduction.kinds holds (the rows its gate admits)."""
WEIGHT_KINDS = ("embeddings", "lm_head", "attention", "mlp", "norms", "rotary")

# The Triton reduction's tile geometry (kernels/triton/prepared.py pick_block_size; the test
# checks these against that module, which cannot be imported here without triton).
TRITON_BLOCK_CAP = 4096
"""DEFAULT_BLOCK_SIZE: vocabulary lanes per tile on a GPU."""
TRITON_INTERPRETED_BLOCK_CAP = 1024
"""RANK_MAX_BLOCK: the interpreter's ranking network (TRITON_INTERPRET=1 on CPU tensors)."""


def dtype_name(dtype: object) -> str:
    """'bf16', 'torch.bfloat16', torch.bfloat16 ... -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of fp32, bf16, fp16")
    return DTYPE_ALIASES[name]


def default_dtype(device: str) -> str:
    """ShardedCausalLM.load's default: FP32 on CPU, BF16 elsewhere."""
    return "float32" if device == "cpu" else "bfloat16"


@dataclass(frozen=True)
class Buffer:
    """``count`` tensors of one shape and dtype that a rank (or the coordinator) holds."""

    section: str
    name: str
    """What it is, for people: 'completion_records', 'attention qkv', 'exchange 2 recv'."""
    path: str
    """Where the live object keeps it, from the RankStep (host frames: from the Engine);
    ``[*]`` stands for every element of a list, tuple or dict."""
    shape: tuple[int, ...]
    dtype: str
    count: int = 1
    kind: str = ""
    """The weight kind (WEIGHT_KINDS) of a weights buffer."""
    shares: str | None = None
    """The path whose storage this one reuses (a tied LM head): it adds no bytes."""
    memory: str = ""
    """Where it lives when that is not its section's memory: "pinned" (page-locked host
    memory listed beside a device section: CUDA's upload twin) or "device" (a device buffer
    of the coordinator's host section: CUDA's copy staging frame)."""

    def __post_init__(self) -> None:
        if self.memory not in ("", "pinned", "device"):
            raise ValueError(f"memory must be '', 'pinned' or 'device', got {self.memory!r}")

    @property
    def nbytes(self) -> int:
        if self.shares is not None:
            return 0
        return self.count * math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        shape = "[" + ", ".join(str(s) for s in self.shape) + "]"
        text = f"{self.dtype} {shape}"
        return f"{self.count} x {text}" if self.count != 1 else text

    def as_dict(self) -> dict:
        out = {"section": self.section, "name": self.name, "path": self.path,
               "shape": list(self.shape), "dtype": self.dtype, "count": self.count,
               "bytes": self.nbytes}
        if self.kind:
            out["kind"] = self.kind
        if self.shares is not None:
            out["shares"] = self.shares
        if self.memory:
            out["memory"] = self.memory
        return out


# ------------------------------------------------------------------------------------------
# What each part of a rank holds
# ------------------------------------------------------------------------------------------


def weight_buffers(config: ModelConfig, layout: ShardLayout, dtype: str) -> tuple[Buffer, ...]:
    """ranks/model/weights.py load_shard_weights and ShardedCausalLM.__init__: the vocabulary
    rows padded to local_width, fused column-parallel qkv and gate_up, row-parallel o_proj
    and down, replicated norms and row-parallel biases, and the FP32 RoPE frequencies."""
    hidden, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    q = layout.local_heads * hd
    kv = layout.local_kv_heads * hd
    inter = layout.local_intermediate
    w = "model.weights."
    lay = w + "layers[*]."

    def weight(kind: str, name: str, path: str, shape: tuple[int, ...], count: int = 1,
               dt: str = dtype, shares: str | None = None) -> Buffer:
        return Buffer("weights", name, path, shape, dt, count, kind, shares)

    vocab_rows = (layout.local_width, hidden)
    out = [weight("embeddings", "embed_tokens", w + "embed", vocab_rows)]
    if config.tie_word_embeddings:
        out.append(weight("lm_head", "lm_head (tied)", w + "lm_head", vocab_rows,
                          shares=w + "embed"))
    else:
        out.append(weight("lm_head", "lm_head", w + "lm_head", vocab_rows))
    out.append(weight("attention", "qkv", lay + "qkv", (q + 2 * kv, hidden), layers))
    if config.qkv_bias:
        out.append(weight("attention", "qkv bias", lay + "qkv_bias", (q + 2 * kv,), layers))
    if config.qk_norm:
        out.append(weight("attention", "q_norm", lay + "q_norm", (hd,), layers))
        out.append(weight("attention", "k_norm", lay + "k_norm", (hd,), layers))
    out.append(weight("attention", "o_proj", lay + "o_proj", (hidden, q), layers))
    if config.o_bias:
        out.append(weight("attention", "o_proj bias", lay + "o_bias", (hidden,), layers))
    out.append(weight("mlp", "gate_up", lay + "gate_up", (2 * inter, hidden), layers))
    if config.mlp_bias:
        out.append(weight("mlp", "gate_up bias", lay + "gate_up_bias", (2 * inter,), layers))
    out.append(weight("mlp", "down", lay + "down", (hidden, inter), layers))
    if config.mlp_bias:
        out.append(weight("mlp", "down bias", lay + "down_bias", (hidden,), layers))
    out.append(weight("norms", "input_layernorm", lay + "input_norm", (hidden,), layers))
    out.append(weight("norms", "post_attention_layernorm", lay + "post_norm", (hidden,),
                      layers))
    out.append(weight("norms", "final norm", w + "final_norm", (hidden,)))
    out.append(weight("rotary", "inv_freq", "model.inv_freq", (hd // 2,), dt="float32"))
    return tuple(out)


def kv_cache_buffers(
    config: ModelConfig, layout: ShardLayout, dtype: str, capacity: int, max_seq_len: int
) -> tuple[Buffer, ...]:
    """ShardedCausalLM.allocate_cache: per layer K and V [capacity, max_seq_len,
    local_kv_heads, head_dim]."""
    shape = (capacity, max_seq_len, layout.local_kv_heads, config.head_dim)
    layers = config.num_hidden_layers
    return (
        Buffer("kv_cache", "keys", "model.cache.keys[*]", shape, dtype, layers),
        Buffer("kv_cache", "values", "model.cache.values[*]", shape, dtype, layers),
    )


def kv_bytes_per_token(config: ModelConfig, layout: ShardLayout, dtype: str) -> int:
    """One token of one slot: K and V of every layer, this rank's KV heads."""
    return (2 * config.num_hidden_layers * layout.local_kv_heads * config.head_dim
            * DTYPE_BYTES[dtype])


def completion_buffers(step: StepConfig) -> tuple[Buffer, ...]:
    """ranks/step/rank_step.py completion_outputs: CompletionOutputs.allocate (K=20, and the
    records-only core with logprobs off, which still allocates the complete bundle) or
    allocate_natural (1 <= K < 20: payload [2, capacity, T, 2+2K], no ID inputs)."""
    cap, t = step.capacity, resolve_completion_token_capacity(step.token_capacity)
    natural = 0 < step.max_logprobs < EXPORT_K
    words = FIRST_PAIR + 2 * step.max_logprobs if natural else PAYLOAD_WORDS
    o = "outputs."
    out = [
        Buffer("completion", COMPLETION_RECORDS, o + COMPLETION_RECORDS,
               (FRAMES, cap, record_width(t)), "int64"),
        Buffer("completion", COMPLETION_LOGPROBS, o + COMPLETION_LOGPROBS,
               (FRAMES, cap, t, words), "int32"),
        Buffer("completion", LOGPROB_REQUESTED, o + LOGPROB_REQUESTED, (cap,), "int32"),
    ]
    if not natural:
        out += [
            Buffer("completion", LOGPROB_TOKEN_IDS, o + LOGPROB_TOKEN_IDS,
                   (cap, MAX_TOKEN_IDS), "int32"),
            Buffer("completion", LOGPROB_TOKEN_ID_COUNTS, o + LOGPROB_TOKEN_ID_COUNTS, (cap,),
                   "int32"),
        ]
    return tuple(out)


def exchange_buffers(
    section: str, label: str, path: str, rows: int, words: int, world: int
) -> tuple[Buffer, Buffer]:
    """collectives/exchange.py WordExchange: send [rows, words] and recv [world * rows,
    words] int32, allocated whatever the group size."""
    return (
        Buffer(section, f"{label} send", path + ".send", (rows, words), "int32"),
        Buffer(section, f"{label} recv", path + ".recv", (world * rows, words), "int32"),
    )


def input_buffers(step: StepConfig, cuda: bool = False) -> tuple[Buffer, ...]:
    """ranks/step/inputs.py StepBuffers: one int64 vector holding token ids, positions and
    slots [token budget each], forward rows [max_rows + chunk_limit] and the rows' slots,
    epochs and positions [3 x max_rows], the frame index [1]; on CUDA its pinned host twin
    (prepare writes there and uploads it whole), host memory outside the device bytes."""
    n = 3 * step.token_budget + step.max_rows + step.chunk_limit + 3 * step.max_rows + 1
    out = [Buffer("inputs", "step inputs", "buffers.values", (n,), "int64")]
    if cuda:
        out.append(Buffer("inputs", "step inputs (pinned upload twin)", "buffers.host", (n,),
                          "int64", memory="pinned"))
    return tuple(out)


def sampler_buffers(step: StepConfig, layout: ShardLayout,
                    cuda: bool = False) -> tuple[Buffer, ...]:
    """ranks/sampler/sampler.py ShardedSampler: the FP32 scratch [rows, local_width], the lanes'
    global ids [local_width] (the capture-safe Gumbel-max's), the plan's four typed pools at
    their start-up sizes (ranks/sampler/buffers.py PlanBuffers; on CUDA each with a pinned
    host twin), the tokens [rows] and best [2, rows] of the capture-safe path, and the filter
    (256 words) and pick (3 words) exchanges, for the submission's most sampling rows
    (StepConfig.max_rows: capacity x (1 + N) with N speculative proposals)."""
    cap, world = step.max_rows, layout.tp_size
    cells = cap * PLAN_CELLS_PER_ROW
    pools = {"int64": 24 * cap + 3 * cells, "float32": 4 * cap + 2 * cells,
             "float64": 4 * cap, "bool": cap * (layout.local_valid + 2)}
    plan = []
    for dtype, size in pools.items():
        path = f"sampler.buffers.{dtype}."
        plan.append(Buffer("sampler", f"plan pool {dtype}", path + "values", (size,), dtype))
        if cuda:
            plan.append(Buffer("sampler", f"plan pool {dtype} (pinned upload twin)",
                               path + "host", (size,), dtype, memory="pinned"))
    return (
        Buffer("sampler", "scratch", "sampler.scratch", (cap, layout.local_width), "float32"),
        Buffer("sampler", "lane ids", "sampler.lane_ids", (layout.local_width,), "int64"),
        *plan,
        Buffer("sampler", "tokens", "sampler.tokens", (cap,), "int64"),
        Buffer("sampler", "best", "sampler.best", (2, cap), "int64"),
        *exchange_buffers("sampler", "filter exchange", "sampler.filter_exchange", cap,
                          FILTER_WORDS, world),
        *exchange_buffers("sampler", "pick exchange", "sampler.pick_exchange", cap,
                          PICK_WORDS, world),
    )


def triton_tiles(local_width: int, interpreted: bool) -> int:
    """Tiles per row of kernels/triton/prepared.py PreparedWorkspaces for a shard."""
    cap = TRITON_INTERPRETED_BLOCK_CAP if interpreted else TRITON_BLOCK_CAP
    block = min(cap, max(1 << max(local_width - 1, 0).bit_length(), TILE_CANDIDATES))
    return -(-local_width // block)


def shard_starts(config: ModelConfig, world: int) -> tuple[int, ...]:
    """kernels/sharded.py agreed_shard_starts: world + 1 starts."""
    width = -(-config.vocab_size // world)
    starts = [min(r * width, config.vocab_size) for r in range(world)]
    return (*starts, config.vocab_size)


def reduction_buffers(
    step: StepConfig,
    config: ModelConfig,
    layout: ShardLayout,
    dtype: str,
    interpreted: bool = False,
) -> tuple[Buffer, ...]:
    """ranks/step/reduce.py StepReduction (only with logprob outputs), for the submission's
    most sampling rows (StepConfig.max_rows): its logit rows and per-row request, the gated
    record kinds, the driver's two exchanges and lse (kernels/sharded.py), and with the
    Triton backend the prepared launches' workspaces and shard-start tensors
    (kernels/triton/sharded.py PreparedShardedReduction)."""
    if not step.logprobs:
        return ()
    cap, world, width = step.max_rows, layout.tp_size, layout.local_width
    r = "reduction."
    tokens = resolve_completion_token_capacity(step.token_capacity)
    out = [
        # (processed modes: the reduction reads the sampler's scratch, listed there)
        *(() if step.processed else (
            Buffer("reduction", "logits", r + "logits", (cap, width), dtype),)),
        Buffer("reduction", "entropy", r + "entropy", (cap,), "float32"),
        Buffer("reduction", "entropy frames", r + "entropy_frames",
               (FRAMES, step.capacity, tokens), "float32"),
        *(() if step.normalized else (
            Buffer("reduction", "unit exchange 1", r + "driver.unit_e1",
                   (world, cap, EXCHANGE1_WORDS), "int32"),)),
        Buffer("reduction", "rows", r + "rows", (cap,), "int64"),
        Buffer("reduction", "gated kinds", r + "kinds", (len(GATED_KINDS),), "int64"),
        Buffer("reduction", "chosen", r + "chosen", (cap,), "int64"),
        Buffer("reduction", "requested", r + "requested", (cap,), "int32"),
        Buffer("reduction", "ids", r + "ids", (cap, MAX_TOKEN_IDS), "int32"),
        Buffer("reduction", "counts", r + "counts", (cap,), "int32"),
        Buffer("reduction", "out", r + "out", (cap, PAYLOAD_WORDS), "int32"),
        *exchange_buffers("reduction", "exchange 1", r + "driver.exchange1", cap,
                          EXCHANGE1_WORDS, world),
        *exchange_buffers("reduction", "exchange 2", r + "driver.exchange2", cap,
                          EXCHANGE2_WORDS, world),
        Buffer("reduction", "lse", r + "driver.lse", (cap,), "float32"),
    ]
    if step.reduction_backend == "triton":
        tiles = triton_tiles(width, interpreted)
        k = r + "kernels."
        out += [
            Buffer("reduction", "triton tile_max", k + "tile_max", (cap, tiles), "float32"),
            Buffer("reduction", "triton tile_mass", k + "tile_mass", (cap, tiles), "float32"),
            Buffer("reduction", "triton cand", k + "cand", (cap, tiles * TILE_CANDIDATES),
                   "int64"),
            Buffer("reduction", "triton no_ids", k + "no_ids", (cap, MAX_TOKEN_IDS), "int32"),
            Buffer("reduction", "triton no_counts", k + "no_counts", (cap,), "int32"),
        ]
        # starts_tensor caches one int64 tensor per distinct starts tuple: the warm-up's
        # (0, width) and the bundle's shard starts (the same tuple at TP1).
        starts = shard_starts(config, world)
        out.append(Buffer("reduction", "triton shard starts", k + "_starts[*]",
                          (len(starts),), "int64"))
        if starts != (0, width):
            out.append(Buffer("reduction", "triton warm-up starts", k + "_starts[*]", (2,),
                              "int64"))
    return tuple(out)


def scored_frame_buffers(step: StepConfig) -> tuple[Buffer, ...]:
    """ranks/step/scoring.py ScoredFrames: each ladder capacity C's prompt_logprobs
    [2, C, 43] and prompt_target_tokens [C] (none without --prompt-logprobs)."""
    if not step.prompt_logprobs:
        return ()
    out = []
    for i, c in enumerate(scored_capacities(step.chunk_limit)):
        rung = f"scorer.ladder[{i}]."
        out += [
            Buffer("scoring", f"{PROMPT_LOGPROBS} C={c}", rung + PROMPT_LOGPROBS,
                   (FRAMES, c, PROMPT_ROW_WORDS), "int32"),
            Buffer("scoring", f"{PROMPT_TARGET_TOKENS} C={c}", rung + PROMPT_TARGET_TOKENS,
                   (c,), "int32"),
        ]
    return tuple(out)


def scoring_buffers(step: StepConfig, layout: ShardLayout, dtype: str) -> tuple[Buffer, ...]:
    """ranks/step/scoring.py PromptScorer (only with --prompt-logprobs): the ladder's frames,
    the [64, local_vocabulary] logit block and the two 64-word scoring exchanges
    (kernels/scoring/driver.py) with its lse and reported values, for 64 rows."""
    if not step.prompt_logprobs:
        return ()
    world = layout.tp_size
    return (
        *scored_frame_buffers(step),
        Buffer("scoring", "projection block", "scorer.block",
               (PROMPT_BLOCK_ROWS, layout.local_width), dtype),
        *exchange_buffers("scoring", "scoring exchange 1", "scorer.scoring.exchange1",
                          PROMPT_BLOCK_ROWS, PROMPT_EXCHANGE_WORDS, world),
        *exchange_buffers("scoring", "scoring exchange 2", "scorer.scoring.exchange2",
                          PROMPT_BLOCK_ROWS, PROMPT_EXCHANGE_WORDS, world),
        Buffer("scoring", "scoring lse", "scorer.scoring.lse", (PROMPT_BLOCK_ROWS,), "float32"),
        Buffer("scoring", "scoring values", "scorer.scoring.value", (PROMPT_BLOCK_ROWS,),
               "float32"),
    )


def host_buffers(step: StepConfig, cuda: bool = False) -> tuple[Buffer, ...]:
    """The coordinator's host frames (pinned on CUDA), paths from the Engine:
    runtime/engine/executor.py FrameExecutor (records, and the payload's full width with
    logprob outputs or only the chosen pair without; with them the entropy frames too; on
    CUDA also its device staging frame, where the requesting runs are packed before their
    transfer: device memory of rank 0) and runtime/engine/prompt_reader.py PromptReader (the
    largest scored capacity's rows)."""
    cap, t = step.capacity, resolve_completion_token_capacity(step.token_capacity)
    payload = [b for b in completion_buffers(step) if b.name == COMPLETION_LOGPROBS][0]
    words = payload.shape[-1] if step.logprobs else FIRST_PAIR
    out = [
        Buffer("host", "host records", "executor.host_records", (FRAMES, cap, record_width(t)),
               "int64"),
        Buffer("host", "host payload", "executor.host_payload", (FRAMES, cap, t, words),
               "int32"),
        # (return_entropy: the reduction's entropy frame, copied for plans that ask for it)
        *((Buffer("host", "host entropy", "executor.host_entropy", (FRAMES, cap, t),
                  "float32"),) if step.logprobs else ()),
    ]
    if cuda:
        out.append(Buffer("host", "copy staging frame", "executor.staging",
                          (cap * t * words,), "int32", memory="device"))
    if step.prompt_logprobs:
        out.append(Buffer("host", "host prompt rows", "prompts.host",
                          (step.chunk_limit, PROMPT_ROW_WORDS), "int32"))
    return tuple(out)


# ------------------------------------------------------------------------------------------
# A rank, a job
# ------------------------------------------------------------------------------------------
