"""Time per step of the sharded sampler at TP1 (one process, CPU torch path).

Rows: greedy, temperature-only (T=0.8, and T=0.3: rows spread past the noise's range, whose
lanes far below the best need no bits), top-k (k=50), top-p (p=0.9), min-p (0.05), a
repetition penalty of 1.1 over a 200-token prompt and 64 generated tokens ("rep 1.1", T=0.8),
and a batch alternating greedy and temperature-only rows ("mixed"); batch 1 and 16; vocabulary
32,000 and 151,936. Logits are N(0, 3^2) with a spike of +12 per row (`--logits flat`, the
default: nearly every lane keeps a probability above 2^-44), or N(0, 2.5^2) with a spike of
+30 (`--logits peaked`, a confident model's row: at T=0.8 most lanes' probability is below
2^-44, a top-p weight of 0). Prints the median over repeats and the ratio of each kind to
greedy at the same batch and vocabulary. ``--capture-safe`` adds the capture-safe sampler
(``ShardedSampler(capture_safe=True)``: every lane's noise drawn, dense radix rounds, no host
read; the path CUDA and a compiled step take) beside the CPU's default, with its ratio to it.

Top-p does NOT gather the vocabulary row at any TP degree: its boundary comes from a 5-round
radix select over fixed-point probability-mass histograms (256 int32 words per row per rank
per round). Top-k <= 256 exchanges each shard's best k values; greedy and temperature-only
rows exchange only the final (score, id) pick, 3 words per row.

Usage: python -m bench.sampler [--repeats N] [--threads N] [--logits flat|peaked]
                               [--capture-safe] [--vocab V ...] [--batch B ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

KINDS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "temperature 0.3": dict(temperature=0.3),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "rep 1.1": dict(temperature=0.8, repetition_penalty=1.1),
    "mixed": (dict(temperature=0.0), dict(temperature=0.8)),
}
"""Each kind's sampling parameters; a tuple is cycled over the batch's rows."""


LOGITS = {"flat": (3.0, 12.0), "peaked": (2.5, 30.0)}
"""Standard deviation of the logits and the spike added to one lane of each row."""


def time_kinds(vocab: int, batch: int, repeats: int, logits_kind: str,
               capture_safe: bool = False) -> dict[str, float]:
    """Median seconds per step of each kind; kinds are interleaved within every repeat so
    that load from other processes affects them alike."""
    spread, spike = LOGITS[logits_kind]
    gen = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=gen) * spread
    logits[torch.arange(batch), torch.randint(vocab, (batch,), generator=gen)] += spike
    sampler = ShardedSampler(None, 0, vocab, vocab, vocab, max_rows=batch,
                             capture_safe=capture_safe)
    prompts = [torch.randint(vocab, (200,), generator=gen).tolist() for _ in range(batch)]
    outputs = [torch.randint(vocab, (64,), generator=gen).tolist() for _ in range(batch)]
    times: dict[str, list[float]] = {name: [] for name in KINDS}
    for step in range(repeats + 1):
        for name, params in KINDS.items():
            cycle = params if isinstance(params, tuple) else (params,)
            rows = [RowSampling(seed=1000 + i, position=step, **cycle[i % len(cycle)])
                    for i in range(batch)]
            start = time.perf_counter()
            sampler.sample(logits, rows, prompts, outputs)
            if step:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logits", choices=sorted(LOGITS), default="flat")
    parser.add_argument("--capture-safe", action="store_true",
                        help="also time the capture-safe sampler")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats}, "
          f"{args.logits} logits")
    safe_head = f" {'safe ms':>9} {'x default':>9}" if args.capture_safe else ""
    print(f"{'vocab':>7} {'batch':>5} {'kind':>15} {'ms/step':>9} {'x greedy':>9}{safe_head}")
    for vocab in args.vocab:
        for batch in args.batch:
            medians = time_kinds(vocab, batch, args.repeats, args.logits)
            safe = time_kinds(vocab, batch, args.repeats, args.logits, capture_safe=True) \
                if args.capture_safe else {}
            for name, seconds in medians.items():
                ratio = seconds / medians["greedy"]
                line = f"{vocab:>7} {batch:>5} {name:>15} {1e3 * seconds:>9.2f} {ratio:>9.1f}"
                if safe:
                    line += f" {1e3 * safe[name]:>9.2f} {safe[name] / seconds:>9.1f}"
                print(line)


if __name__ == "__main__":
    main()
