"""Decode throughput with and without logprobs, at TP1 and TP2 on CPU (gloo).

    python bench/decode.py [--model DIR] [--tokens 64] [--repeat 3] [--tp 1 2] [--threads N]

Spawns one run per TP size (ranks started like torchrun would). In each run the coordinator
times batches of greedy requests (batch 1 and 16) with no logprobs, logprobs=0 and
logprobs=20, in the same process, the three modes back to back within every repeat (their
order rotating from repeat to repeat), and prints decode tokens/s (median over repeats) and
the median over repeats of each mode's ratio to the no-logprobs run of the same repeat: on a
shared machine throughput drifts by 20% within seconds, and modes timed back to back see
nearly the same load. Prefill is excluded: every request has a 4-token prompt, and the time
to the first token is subtracted per batch. "steal" is the median share of the host's CPU
time that the hypervisor gave to other guests while the mode ran (bench/host.py): a ratio
measured under high steal is the neighbours', not the code's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"none": None, "K=0": 0, "K=20": 20}


def time_batch(engine, batch: int, tokens: int, logprobs: int | None) -> float:
    from helios_logprobs.runtime.engine.client import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs)
    short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
    with ThreadPoolExecutor(batch) as pool:
        start = time.perf_counter()
        list(pool.map(lambda p: engine.generate_sync(p, short), prompts))
        first = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(lambda p: engine.generate_sync(p, params), prompts))
        total = time.perf_counter() - start
    return batch * (tokens - 1) / max(total - first, 1e-9)


def worker(args: argparse.Namespace) -> int:
    import torch

    from bench.host import cpu_counters, steal_share
    from helios_logprobs.launch.arguments import add_runtime_arguments
    from helios_logprobs.launch.cluster import join

    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)  # every other serving option keeps its default
    argv = ["--capacity", "16", "--chunk-size", "256", "--collective-timeout", "60",
            "--heartbeat-timeout", "10", "--log-level", "ERROR"]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    ns = parser.parse_args(argv)
    cluster = join(ns)
    if args.threads:
        torch.set_num_threads(args.threads)  # join sets cores // local ranks
    if not cluster.is_coordinator:
        return cluster.run_peer()
    engine = cluster.engine()
    try:
        time_batch(engine, 2, 8, 20)
        rows = {}
        names = list(MODES)
        for batch in (1, 16):
            runs: dict[str, list[float]] = {name: [] for name in MODES}
            stolen: dict[str, list[float]] = {name: [] for name in MODES}
            for repeat in range(args.repeat):
                for name in names[repeat % 3:] + names[: repeat % 3]:
                    counters = cpu_counters()
                    runs[name].append(time_batch(engine, batch, args.tokens, MODES[name]))
                    share = steal_share(counters, cpu_counters())
                    if share is not None:
                        stolen[name].append(share)
            for name in MODES:
                rows[f"{batch}/{name}"] = statistics.median(runs[name])
                rows[f"{batch}/{name}/steal"] = (statistics.median(stolen[name])
                                                 if stolen[name] else None)
                rows[f"{batch}/{name}/ratio"] = statistics.median(
                    a / b for a, b in zip(runs[name], runs["none"], strict=True))
        Path(args.output).write_text(json.dumps(rows))
    finally:
        cluster.close(engine)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny",
                   help="what launch.serve's --model takes (default: the embedded tiny model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per rank (0: cores // ranks, as serving does)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--output", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from bench.host import share_text
    from tests.distributed.launcher import start_ranks, stop

    print(f"decode tokens/s (median of {args.repeat}), {args.tokens} tokens per request")
    print(f"{'TP':>3} {'batch':>5} {'mode':>6} {'tok/s':>9} {'vs none':>8} {'of medians':>10}"
          f" {'steal':>6}")
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            extra = ["--model", str(args.model)] if args.model else []
            cmd = ["bench.decode", "--worker", "--output", str(out), "--tokens",
                   str(args.tokens), "--repeat", str(args.repeat), "--threads",
                   str(args.threads), *extra]
            procs = start_ranks(cmd[0], cmd[1:], tp)
            try:
                if any(p.wait(timeout=1800) for p in procs):
                    raise SystemExit(f"TP{tp} run failed")
            finally:
                stop(procs)
            rows = json.loads(out.read_text())
        for batch in (1, 16):
            base = rows[f"{batch}/none"]
            for name in MODES:
                value, ratio = rows[f"{batch}/{name}"], rows[f"{batch}/{name}/ratio"]
                steal = rows[f"{batch}/{name}/steal"]
                print(f"{tp:>3} {batch:>5} {name:>6} {value:>9.1f} {ratio:>8.3f} "
                      f"{value / base:>10.3f} {share_text(steal):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
