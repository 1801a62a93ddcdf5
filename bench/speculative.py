"""Decode throughput with speculative rounds (history proposals), at TP1 in one process.

    python bench/speculative.py [--model DIR] [--tokens 64] [--batch 8] [--repeat 3]

For each workload, one engine per speculative_tokens (off, N = 2, N = 4; N = 4 also with
K=20 logprobs) runs the same batch of requests on the calling thread (Engine.run_offline, no
step thread). Decode time is the time of every submission after the first one, which
prefills every prompt (and samples the first tokens), so prefill is excluded; each includes
planning, proposals, the rank step, the frame copy and decoding. Configurations are
interleaved within each repeat. Workloads:

- repetitive: greedy requests whose prompts repeat a phrase (outputs tend to repeat too, so
  history proposals are often accepted);
- non-repetitive: seeded sampling at temperature 1.0 over varied prompts (few proposals, and
  few accepted).

Printed per workload: decode tokens/s (median over repeats), the ratio to speculation off,
the acceptance rate (accepted / offered proposals) and tokens per round, and the cost of K=20
logprobs with speculation on as the ratio of N = 4 with K=20 to N = 4 without logprobs (and,
for reference, the same ratio with speculation off).
The model defaults to the embedded tiny model (launch/tiny_model.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = (("off", 0, None), ("N=2", 2, None), ("N=4", 4, None), ("off K=20", 0, 20),
           ("N=4 K=20", 4, 20))


def workloads(batch: int, vocab: int) -> dict[str, tuple[list[list[int]], dict]]:
    rng = random.Random(1)
    phrases = [[rng.randrange(10, vocab) for _ in range(6)] for _ in range(batch)]
    repetitive = [p * 4 for p in phrases]
    varied = [[rng.randrange(10, vocab) for _ in range(24)] for _ in range(batch)]
    return {
        "repetitive": (repetitive, {"temperature": 0.0}),
        "non-repetitive": (varied, {"temperature": 1.0, "seed": 7}),
    }


def decode_rate(engine, prompts, sampling: dict, tokens: int, logprobs: int | None) -> float:
    """Decode tokens/s of one batch: the time of every submission after the first, which
    prefills every prompt (the batch fits the slots and the token budget)."""
    from helios_logprobs.runtime.engine.client import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs, **sampling)
    times, plans = [], []
    step_once, next_plan = engine.step_once, engine.scheduler.next_plan

    def timed_step(*args):
        start = time.perf_counter()
        ran = step_once(*args)
        times.append(time.perf_counter() - start)
        return ran

    def recorded_plan():
        nxt = next_plan()
        if nxt is not None:
            plans.append(nxt[0])
        return nxt

    engine.step_once, engine.scheduler.next_plan = timed_step, recorded_plan
    try:
        results = engine.run_offline([(p, params) for p in prompts])
    finally:
        del engine.step_once, engine.scheduler.next_plan
    for events in results:
        if not events or type(events[-1]).__name__ != "Finished":
            raise SystemExit(f"request failed: {events[-1:]}")
    if sum(w.request is not None for w in plans[0].work) != len(prompts) or any(
        w.request is not None for plan in plans[1:] for w in plan.work
    ):
        raise SystemExit("the first submission must prefill every prompt, and only it")
    return len(prompts) * (tokens - 1) / sum(times[1 : len(plans)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: steady figures on a shared machine)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    if args.model is None:
        from helios_logprobs.launch.tiny_model import ensure_tiny_model

        args.model = ensure_tiny_model()
    engines = {}
    for _name, n, _ in CONFIGS:
        if n not in engines:
            config = RuntimeConfig(model_dir=args.model, capacity=args.batch,
                                   max_model_len=64 + args.tokens + 8, speculative_tokens=n,
                                   ngram_min=args.ngram_min, ngram_max=args.ngram_max)
            engines[n] = build_engine(config, load_rank(config, None))
    vocab = engines[0].info.vocab_size
    print(f"decode tokens/s at TP1 on {engines[0].step.device}, median of {args.repeat}; "
          f"batch {args.batch}, {args.tokens} tokens per request, "
          f"ngram {args.ngram_min}..{args.ngram_max}")
    print(f"{'workload':>15} {'config':>9} {'tok/s':>9} {'vs off':>7} {'accept':>7} "
          f"{'tok/round':>9}")
    for workload, (prompts, sampling) in workloads(args.batch, vocab).items():
        runs: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
        counts: dict[str, list[int]] = {name: [0, 0, 0, 0] for name, _, _ in CONFIGS}
        for engine in engines.values():
            decode_rate(engine, prompts[:2], sampling, 4, None)  # warm-up
        for _ in range(args.repeat):  # configurations interleaved, so drift hits them alike
            for name, n, logprobs in CONFIGS:
                before = _counters(engines[n])
                runs[name].append(decode_rate(engines[n], prompts, sampling, args.tokens,
                                              logprobs))
                after = _counters(engines[n])
                counts[name] = [c + a - b for c, a, b in zip(counts[name], after, before,
                                                              strict=True)]
        rates = {name: statistics.median(values) for name, values in runs.items()}
        for name, _, _ in CONFIGS:
            offered, accepted, rounds, emitted = counts[name]
            accept = f"{accepted / offered:7.3f}" if offered else f"{'-':>7}"
            per_round = f"{emitted / rounds:9.2f}" if rounds else f"{'-':>9}"
            print(f"{workload:>15} {name:>9} {rates[name]:>9.1f} "
                  f"{rates[name] / rates['off']:>7.3f} {accept} {per_round}")
        print(f"{workload:>15} K=20 cost with N=4: {rates['N=4 K=20'] / rates['N=4']:.3f} "
              f"(tokens/s ratio, N=4 K=20 vs N=4 without logprobs); without speculation: "
              f"{rates['off K=20'] / rates['off']:.3f}")
    return 0


def _counters(engine) -> tuple[int, int, int, int]:
    c = engine.speculation
    return c.offered, c.accepted, c.rounds, c.emitted


if __name__ == "__main__":
    sys.exit(main())
