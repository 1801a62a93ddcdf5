"""helios-capacity: what a serving configuration costs per rank, before anything is loaded.

Takes the model and sizing arguments of launch.serve (the same names and defaults) plus the
tensor-parallel size and a per-rank memory budget, reads the checkpoint's config.json and
prints, per rank: the weights by kind, every fixed buffer (completion bundle, sampler,
logprob reduction, prompt scoring with --prompt-logprobs), the coordinator's host frames, the
KV cache's bytes per token, and how many tokens and full-length sequences of KV cache the
rest of the budget holds. With --prompt-logprobs it also prints what the flag costs. It
loads no weights and allocates no tensors; every figure comes from ranks/capacity/sizing.py, which
the tests hold to the tensors real ranks allocate.

Exit status: 0, or 2 for a bad argument or a budget too small for the weights and fixed
buffers (the message says by how much).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from helios_logprobs.launch.arguments import add_runtime_arguments
from helios_logprobs.launch.capacity_report import (
    Plan,
    UsageError,
    human,
    report,
    shortfall_message,
)
from helios_logprobs.ranks.capacity.buffers import FIXED_SECTIONS, WEIGHT_KINDS, Buffer
from helios_logprobs.ranks.capacity.sizing import JobSizing, RankSizing

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SECTION_TITLES = {
    "inputs": "step inputs",
    "completion": "completion bundle",
    "sampler": "sampler",
    "reduction": "logprob reduction",
    "scoring": "prompt scoring",
}


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """'80GiB', '24 GB', '1.5KiB', '81920000000', '2e9' -> bytes (> 0)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB, 24GB, 85899345920)")
    value = float(match.group(1)) * UNITS[match.group(2).lower()]
    if not value >= 1:
        raise ValueError(f"memory size must be at least one byte, got {text!r}")
    return int(value)


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="helios-capacity",
        description="Per-rank memory of a serving configuration: weights, fixed buffers, "
                    "host frames and the KV cache the rest of the budget holds.",
    )
    add_runtime_arguments(p)
    try:  # launch.serve's option, added here where the shared set does not have it yet
        p.add_argument("--prompt-logprobs", action="store_true",
                       help="allocate prompt scoring (prompt_logprobs, echo with logprobs)")
    except argparse.ArgumentError:
        pass
    try:  # likewise
        p.add_argument("--speculative-tokens", type=int, default=0,
                       help="N proposals a speculative round verifies (0: off)")
    except argparse.ArgumentError:
        pass
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (ranks)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="where the ranks run; default: cuda when this host has a GPU")
    p.add_argument("--device-memory", type=_memory, default=None,
                   help="memory per rank, bytes or with a unit (80GiB, 24GB); default: this "
                        "host's GPU; required on CPU")
    p.add_argument("--memory-utilization", type=_fraction, default=0.9,
                   help="fraction of --device-memory the rank may use (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


# ------------------------------------------------------------------------------------------
# The computation
# ------------------------------------------------------------------------------------------


def table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    """Aligned columns; ``right``: indices of right-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def shape_text(b: Buffer) -> str:
    shape = "[" + ", ".join(str(s) for s in b.shape) + "]"
    return f"{b.count} x {shape}" if b.count != 1 else shape


def weight_rows(sizing: RankSizing, dtype: str) -> list[tuple[str, ...]]:
    """One row per weight kind: '24 x (qkv [1152, 896] + o_proj [896, 896])'."""
    rows = []
    for kind in WEIGHT_KINDS:
        parts = [b for b in sizing.section("weights") if b.kind == kind]
        if not parts:
            continue
        if all(b.shares for b in parts):
            detail = "tied: the embedding shard itself"
        else:
            terms = []
            for count in sorted({b.count for b in parts}, reverse=True):
                names = " + ".join(
                    f"{b.name} {list(b.shape)}" + (f" {b.dtype}" if b.dtype != dtype else "")
                    for b in parts if b.count == count
                )
                many = count != 1
                terms.append(f"{count} x ({names})" if many and " + " in names
                             else f"{count} x {names}" if many else names)
            detail = " + ".join(terms)
        rows.append((kind, detail, human(sum(b.nbytes for b in parts))))
    return rows


def rank_ranges(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def render(plan: Plan, rep: dict) -> str:
    m, step, job = plan.model, plan.step, plan.job
    s = rep["settings"]
    lines = [
        f"helios-capacity: {plan.model_dir.name} ({m.architecture}: vocab {m.vocab_size}, "
        f"hidden {m.hidden_size}, MLP {m.intermediate_size}, {m.num_hidden_layers} layers, "
        f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV heads, "
        f"{'tied' if m.tie_word_embeddings else 'untied'} LM head)",
        f"TP {plan.tp} on {plan.device}, {plan.dtype}; capacity {step.capacity} x "
        f"max-model-len {step.max_seq_len}, chunk {step.chunk_limit}, "
        f"T={s['completion_token_capacity']}, "
        f"K={step.max_logprobs if step.logprobs else 'off'}, prompt logprobs "
        f"{'on' if step.prompt_logprobs else 'off'}, reduction {step.reduction_backend}",
        f"budget per rank: {human(plan.device_memory)} x {plan.utilization:g} = "
        f"{human(plan.usable)}",
        "",
    ]
    rows = [("rank", "vocabulary ids", "valid", "padding", "weights", "fixed",
             "host frames", "KV tokens")]
    for r, b in zip(job.ranks, job.budgets, strict=True):
        lay = r.layout
        rows.append((str(r.rank), f"[{lay.vocab_start}, {lay.vocab_end})",
                     str(lay.local_valid), str(lay.local_width - lay.local_valid),
                     human(r.weight_bytes), human(r.fixed_bytes),
                     human(r.host_bytes) if r.host else "-", f"{b.kv_tokens:,}"))
    lines += table(rows, right=(2, 3, 4, 5, 6, 7))
    # Ranks whose device buffers are identical (they all are unless a model is unusual)
    # share one detailed table.
    groups: dict[tuple, list[int]] = {}
    for r in job.ranks:
        key = tuple((b.section, b.name, b.shape, b.dtype, b.count) for b in r.buffers)
        groups.setdefault(key, []).append(r.rank)
    for ranks in groups.values():
        r = job.ranks[ranks[0]]
        lines += ["", f"Device memory of {rank_ranges(ranks)}"
                  + (", each:" if len(ranks) > 1 else ":")]
        rows = [("section", "buffer", "layout", "bytes")]
        for kind, detail, size in weight_rows(r, plan.dtype):
            rows.append(("weights" if len(rows) == 1 else "", kind, detail, size))
        rows.append(("", "total weights", "", human(r.weight_bytes)))
        for section in FIXED_SECTIONS:
            first = True
            for b in r.section(section):
                rows.append((SECTION_TITLES[section] if first else "", b.name, b.describe(),
                             human(b.nbytes)))
                first = False
        rows.append(("", "total fixed buffers", "", human(r.fixed_bytes)))
        kv = r.kv_cache[0]
        rows.append(("KV cache", "per token",
                     f"2 x {m.num_hidden_layers} layers x {r.layout.local_kv_heads} KV heads x "
                     f"{m.head_dim} x {plan.dtype}", human(r.kv_bytes_per_token)))
        rows.append(("", "configured cache",
                     f"K and V: 2 x {kv.count} layers x {list(kv.shape)}",
                     human(r.kv_cache_bytes)))
        lines += table(rows, right=(3,))
    host = job.ranks[0].host
    if host:
        kind = "plain host memory, in the budget on CPU" if plan.cpu else "pinned"
        lines += ["", f"Host frames on the coordinator (rank 0, {kind}):"]
        rows = [("buffer", "layout", "bytes")]
        rows += [(b.name, b.describe(), human(b.nbytes)) for b in host]
        rows.append(("total", "", human(job.ranks[0].host_bytes)))
        lines += table(rows, right=(2,))
    lines += ["", *kv_lines(plan, rep["kv"], job)]
    if plan.without is not None:
        lines += ["", *cost_lines(plan, rep)]
    return "\n".join(lines)


def kv_lines(plan: Plan, kv: dict, job: JobSizing) -> list[str]:
    if job.shortfall:
        return [f"KV cache: none fits; {shortfall_message(plan)}"]
    b = job.tightest
    lines = [
        f"KV capacity per rank: {human(plan.usable)} - weights {human(b.weights)} - fixed "
        f"{human(b.fixed)}" + (f" - host frames {human(b.host)}" if b.host else "")
        + f" = {human(b.remaining)}",
        f"  holds {kv['tokens']:,} tokens ({human(kv['bytes_per_token'])} each) = "
        f"{kv['sequences']:,} full-length sequences of {kv['max_model_len']:,} tokens",
    ]
    verdict = "fits" if kv["configured_fits"] else "does NOT fit"
    lines.append(f"  the configured cache, capacity {plan.step.capacity} x {kv['max_model_len']:,}"
                 f" = {kv['configured_tokens']:,} tokens ({human(kv['configured_bytes'])}), "
                 f"{verdict}; the largest --capacity that fits: {kv['max_capacity']:,}")
    return lines


def cost_lines(plan: Plan, rep: dict) -> list[str]:
    cost = rep["prompt_logprobs_cost"]
    before = rep["without_prompt_logprobs"]
    parts = cost["by_part"]
    return [
        "--prompt-logprobs costs, per rank:",
        f"  fixed device memory: +{human(cost['fixed_bytes'])} (scored frames "
        f"{human(parts['scored_frames'])}, [64, local vocabulary] projection block "
        f"{human(parts['projection_block'])}, scoring exchanges {human(parts['exchanges'])}); "
        f"{cost['fixed_percent_of_usable']:.3f}% of the usable budget",
        f"  coordinator host frames: +{human(cost['host_bytes'])}",
        f"  KV capacity: {before['kv']['tokens']:,} -> {rep['kv']['tokens']:,} tokens, "
        f"-{cost['kv_tokens_lost']:,} tokens ({human(cost['kv_bytes_lost'])}, "
        f"{cost['kv_percent_lost']:.3f}%); full-length sequences "
        f"{before['kv']['sequences']:,} -> {rep['kv']['sequences']:,}; largest --capacity "
        f"{before['kv']['max_capacity']:,} -> {rep['kv']['max_capacity']:,}",
    ]


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad argument (2, already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        plan = Plan(args)
    except UsageError as exc:
        print(f"helios-capacity: error: {exc}", file=sys.stderr)
        return 2
    rep = report(plan)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(render(plan, rep))
    if plan.job.shortfall:
        print(f"helios-capacity: error: {shortfall_message(plan)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
