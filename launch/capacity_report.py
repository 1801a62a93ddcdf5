"""What the capacity report computes (the data behind ``helios-capacity`` and its ``--json``):
the plan from the command line, and each rank's buffers, KV cache and shortfall."""

from __future__ import annotations

import argparse
from dataclasses import replace

from helios_logprobs.launch.arguments import runtime_config
from helios_logprobs.ranks.capacity.buffers import FIXED_SECTIONS, dtype_name
from helios_logprobs.ranks.capacity.sizing import (
    JobSizing,
    RankSizing,
    frame_bytes,
    job_sizing,
    max_capacity,
)
from helios_logprobs.ranks.contract.declarations import resolve_completion_token_capacity
from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.dtype import resolve_dtype


class UsageError(ValueError):
    """A bad argument or an unsupported configuration: exit status 2."""


class Plan:
    """The resolved arguments and every figure of the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch  # for the local GPU's size only; nothing is allocated

        cuda_here = torch.cuda.is_available()
        self.device = args.device or ("cuda" if cuda_here else "cpu")
        memory = args.device_memory
        if memory is None:
            if self.device != "cuda" or not cuda_here:
                raise UsageError("--device-memory is required without a local GPU "
                                 "(e.g. --device-memory 80GiB)")
            memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        self.device_memory = memory
        self.utilization = args.memory_utilization
        self.usable = int(memory * args.memory_utilization)
        self.tp = args.tp
        try:
            self.runtime = runtime_config(args, self.device)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.model_dir = self.runtime.model_dir
        # --dtype as the server resolves it (auto: the checkpoint's on CUDA, float32 on CPU)
        self.dtype = dtype_name(resolve_dtype(self.runtime.dtype, self.device, self.model_dir)[0])
        try:
            self.model = ModelConfig.from_model_dir(self.model_dir)
        except (OSError, ValueError) as exc:  # (ModelConfigError names the file itself)
            raise UsageError(str(exc)) from None
        try:
            max_seq_len = self.runtime.resolve_max_model_len(self.model)
            self.step = self.runtime.step_config(max_seq_len)
            self.job = self._job(self.step)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.without = None
        if self.step.prompt_logprobs:
            self.without = self._job(replace(self.step, prompt_logprobs=False))

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def _job(self, step) -> JobSizing:
        # On CPU the Triton reduction runs in the interpreter (its tile geometry), and the
        # coordinator's host frames live in the same memory as the rank's tensors.
        return job_sizing(self.model, step, self.tp, self.dtype, self.usable,
                          interpreted=self.cpu, host_in_budget=self.cpu, cuda=not self.cpu)

    def largest_capacity(self, step) -> int:
        return max_capacity(self.model, step, self.tp, self.dtype, self.usable,
                            interpreted=self.cpu, host_in_budget=self.cpu, cuda=not self.cpu)


def kv_summary(plan: Plan, job: JobSizing) -> dict:
    step = job.step
    per_token = max(r.kv_bytes_per_token for r in job.ranks)
    return {
        "bytes_per_token": per_token,
        "tokens": job.kv_tokens,
        "bytes": job.kv_tokens * per_token,
        "sequences": job.kv_sequences,
        "max_model_len": step.max_seq_len,
        "configured_tokens": job.configured_kv_tokens,
        "configured_bytes": max(r.kv_cache_bytes for r in job.ranks),
        "configured_fits": job.shortfall == 0 and job.configured_fits,
        "max_capacity": plan.largest_capacity(step) if job.shortfall == 0 else 0,
    }


def rank_report(plan: Plan, sizing: RankSizing, job: JobSizing) -> dict:
    layout = sizing.layout
    budget = job.budgets[sizing.rank]
    out = {
        "rank": sizing.rank,
        "vocab_start": layout.vocab_start,
        "local_width": layout.local_width,
        "local_valid": layout.local_valid,
        "padding": layout.local_width - layout.local_valid,
        "buffers": [b.as_dict() for b in (*sizing.buffers, *sizing.kv_cache)],
        "weights": {"bytes": sizing.weight_bytes, "by_kind": sizing.weight_kind_bytes(),
                    "tied_lm_head": plan.model.tie_word_embeddings},
        "sections": {s: sizing.section_bytes(s) for s in FIXED_SECTIONS},
        "fixed": {"bytes": sizing.fixed_bytes},
        "kv": {
            "bytes_per_token": sizing.kv_bytes_per_token,
            "remaining_bytes": budget.remaining,
            "tokens": budget.kv_tokens,
            "sequences": budget.kv_sequences,
            "configured_bytes": sizing.kv_cache_bytes,
        },
        "device_bytes_at_configured_capacity": sizing.device_bytes,
    }
    if sizing.host:
        out["host"] = {"pinned": not plan.cpu, "in_budget": plan.cpu,
                       "buffers": [b.as_dict() for b in sizing.host],
                       "bytes": sizing.host_bytes,
                       "device_staging_bytes": sizing.staging_bytes}
    return out


def report(plan: Plan) -> dict:
    m, step, job = plan.model, plan.step, plan.job
    out = {
        "model": {
            "dir": str(plan.model_dir), "architecture": m.architecture,
            "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_hidden_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
            "tie_word_embeddings": m.tie_word_embeddings,
        },
        "settings": {
            "tp": plan.tp, "device": plan.device, "dtype": plan.dtype,
            "capacity": step.capacity, "max_model_len": step.max_seq_len,
            "chunk_size": step.chunk_limit,
            "completion_token_capacity": resolve_completion_token_capacity(step.token_capacity),
            "max_logprobs": step.max_logprobs, "prompt_logprobs": step.prompt_logprobs,
            "reduction_backend": step.reduction_backend,
        },
        "budget": {
            "device_memory": plan.device_memory, "memory_utilization": plan.utilization,
            "usable": plan.usable, "host_frames_in_budget": plan.cpu,
        },
        "ranks": [rank_report(plan, r, job) for r in job.ranks],
        "kv": kv_summary(plan, job),
        "memory": memory_report(plan),
        "shortfall": job.shortfall,
        "error": shortfall_message(plan) if job.shortfall else None,
    }
    if plan.without is not None:
        without = plan.without
        out["without_prompt_logprobs"] = {
            "fixed_bytes": max(r.fixed_bytes for r in without.ranks),
            "host_bytes": without.ranks[0].host_bytes,
            "kv": kv_summary(plan, without),
        }
        out["prompt_logprobs_cost"] = prompt_logprobs_cost(plan, out)
    return out


GRAPH_POOL_NOTE = ("0 until CUDA graphs are captured: serving captures none yet (the step runs "
                   "eagerly); /metrics reads the live figure, helios:device_memory_bytes"
                   "{kind=\"graph_pool\"}")


def memory_report(plan: Plan) -> dict:
    """The memory report: the frames' physical bytes (sizing.frame_bytes; ``device`` frames on
    every rank, ``host`` frames on the coordinator), counted apart from the device totals, and
    on CUDA the device totals per rank: ``allocated``, the bytes the tightest rank's tensors
    hold at the configured capacity (weights, fixed buffers, KV cache); ``reserved_limit``,
    what the caching allocator may reserve (--device-memory x --memory-utilization, the
    fraction a server sets with --gpu-memory-utilization); ``graph_pool``, the CUDA graph
    pool's bytes, 0 (GRAPH_POOL_NOTE). On the CPU the device fields are absent: there is no
    device allocator (host and device are one memory, host frames are in the budget)."""
    out: dict = {"frames": frame_bytes(plan.step).as_dict()}
    if not plan.cpu:
        out["device"] = {
            "allocated": max(r.device_bytes for r in plan.job.ranks),
            "reserved_limit": plan.usable,
            "graph_pool": 0,
            "graph_pool_note": GRAPH_POOL_NOTE,
        }
    return out


def prompt_logprobs_cost(plan: Plan, out: dict) -> dict:
    job, without = plan.job, plan.without
    fixed = max(a.fixed_bytes - b.fixed_bytes
                for a, b in zip(job.ranks, without.ranks, strict=True))
    host = job.ranks[0].host_bytes - without.ranks[0].host_bytes
    before, after = out["without_prompt_logprobs"]["kv"], out["kv"]
    lost = before["tokens"] - after["tokens"]
    scoring = job.ranks[0].section("scoring")
    return {
        "fixed_bytes": fixed,
        "fixed_percent_of_usable": 100 * fixed / plan.usable,
        "host_bytes": host,
        "by_part": {
            "scored_frames": sum(b.nbytes for b in scoring if b.path.startswith("scorer.ladder")),
            "projection_block": sum(b.nbytes for b in scoring if b.path == "scorer.block"),
            "exchanges": sum(b.nbytes for b in scoring if ".exchange" in b.path),
        },
        "kv_tokens_lost": lost,
        "kv_bytes_lost": lost * after["bytes_per_token"],
        "kv_percent_lost": 100 * lost / before["tokens"] if before["tokens"] else 0.0,
        "kv_sequences_lost": before["sequences"] - after["sequences"],
        "max_capacity_lost": before["max_capacity"] - after["max_capacity"],
    }


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


def shortfall_message(plan: Plan) -> str:
    b = plan.job.tightest
    host = f" + host frames {human(b.host)}" if b.host else ""
    return (f"the budget is short by {human(-b.remaining)}: rank {b.rank} needs weights "
            f"{human(b.weights)} + fixed buffers {human(b.fixed)}{host} = "
            f"{human(b.weights + b.fixed + b.host)}, but --device-memory "
            f"{human(plan.device_memory)} x --memory-utilization {plan.utilization:g} leaves "
            f"{human(plan.usable)} per rank")


def human(n: int) -> str:
    """Binary units: '96 B', '1.50 KiB', '14.96 GiB'."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.2f} {unit}"
    raise AssertionError
