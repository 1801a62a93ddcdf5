"""Structured outputs: decode tokens/s with a JSON schema against without, and the mask's
cost per step, at TP1 in one process (CPU).

    python bench/structured.py [--model DIR] [--tokens 64] [--batch 1 8] [--repeat 3]
                               [--mask-only]

Throughput: batches of seeded requests (temperature 1, ignore_eos, the same prompts and
token counts) without a constraint and with a JSON schema, the two modes back to back within
every repeat (their order alternating), as tokens/s medians and the median of the per-repeat
ratio (json / none): on a shared machine throughput drifts within seconds, and modes timed
back to back see nearly the same load. "masked" is the share of the json mode's tokens that
were sampled under a live grammar (the rest follow the grammar's end: an ignored EOS ends
it, and later rows are unconstrained, as in vLLM).

Mask cost per step (the same vocabulary): on the coordinator, one matcher round (sync one
committed token, fill one bitmask row: runtime/structured/state.py); on a rank, its shard's
slice of that row as a lane mask (ranks/grammar_mask.py) plus the -inf fill of one scratch
row, for the TP1 shard and a TP2 shard (one torch thread). Microseconds, medians. The rows
are those of the json mode's longest output (with --mask-only, of a seeded random walk
through the grammar: no forward pass, for a large vocabulary on a slow machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string"}},
    "note": {"type": "string"}}, "required": ["items", "note"]}
"""Long outputs: an array of strings and a string, of any length."""


def time_batch(engine, batch: int, tokens: int, spec, repeat: int) -> tuple[float, list]:
    from helios_logprobs.runtime.engine.client import SamplingParams

    jobs = [([5 + i, 6, 7, 8], SamplingParams(max_tokens=tokens, temperature=1.0,
                                              seed=1000 * repeat + i, ignore_eos=True,
                                              structured=spec)) for i in range(batch)]
    with ThreadPoolExecutor(batch) as pool:
        start = time.perf_counter()
        outs = list(pool.map(lambda job: engine.generate_sync(*job), jobs))
        total = time.perf_counter() - start
    return batch * tokens / total, [[t.token_id for t in tokens_] for tokens_, _ in outs]


def masked_share(grammars, spec, outputs: list[list[int]]) -> float:
    """The share of tokens sampled while the grammar was live."""
    live = total = 0
    for ids in outputs:
        state = grammars.state(spec)
        for token in ids:
            total += 1
            if state.terminated:
                continue
            live += 1
            state.matcher.accept_token(token)
    return live / max(total, 1)


def grammar_walk(grammars, spec, tokens: int) -> list[int]:
    """A seeded random walk through the grammar's allowed tokens (never a stop token)."""
    import random

    from helios_logprobs.ranks.grammar_mask import allowed_ids

    rng, state, out = random.Random(0), grammars.state(spec), []
    stops = set(grammars.stop_token_ids)
    for _ in range(tokens):
        _, masks = state.round(out)
        allowed = [int(t) for t in allowed_ids(masks[0], grammars.vocab_size).nonzero()[0]
                   if int(t) not in stops]
        if not allowed:
            break
        out.append(rng.choice(allowed))
    return out


def mask_costs(grammars, spec, sample: list[int], repeat: int) -> dict[str, float]:
    import torch

    from helios_logprobs.ranks.grammar_mask import shard_blocked
    from helios_logprobs.ranks.model.sharding import vocab_shard

    vocab = grammars.vocab_size
    state = grammars.state(spec)
    rounds, rows = [], []
    for k in range(len(sample) + 1):  # (one committed token per round, as in decoding)
        start = time.perf_counter()
        _, masks = state.round(sample[:k])
        rounds.append(time.perf_counter() - start)
        if not masks:
            break
        rows.append(masks[0])
    out = {"coordinator round": statistics.median(rounds) * 1e6}
    # One torch thread: this thread is not the engine's step thread, whose OpenMP workers
    # stay warm; a parallel fill here would time the workers' wake-up instead.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for tp in (1, 2):
        start_id, width, valid = vocab_shard(vocab, tp, 0)
        scratch = torch.zeros(1, valid)
        times = []
        for _ in range(repeat):
            for row in rows:
                start = time.perf_counter()
                blocked = shard_blocked([row], start_id, valid, vocab, scratch.device)
                scratch.masked_fill_(blocked, float("-inf"))
                times.append(time.perf_counter() - start)
        out[f"rank slice+fill TP{tp}"] = statistics.median(times) * 1e6
    torch.set_num_threads(threads)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None,
                   help="what launch.serve's --model takes (default: the default model)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--mask-only", action="store_true",
                   help="only the mask's cost per row (no decoding)")
    args = p.parse_args()

    from helios_logprobs.launch.arguments import add_runtime_arguments
    from helios_logprobs.launch.cluster import join
    from helios_logprobs.runtime.structured.spec import StructuredSpec

    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    argv = ["--capacity", str(max(args.batch)), "--log-level", "ERROR"]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    cluster = join(parser.parse_args(argv))
    engine = cluster.engine()
    spec = StructuredSpec.from_schema(SCHEMA)
    try:
        grammars = engine.scheduler.grammars.get()
        print(f"vocabulary {grammars.vocab_size}, {args.tokens} tokens per request, "
              f"medians of {args.repeat}")
        if args.mask_only:
            args.batch = []
            sample = grammar_walk(grammars, spec, args.tokens)
        else:
            time_batch(engine, 2, 8, spec, 0)  # (warm-up: compiles the grammar too)
            print(f"{'batch':>5} {'none tok/s':>10} {'json tok/s':>10} {'json/none':>9} "
                  f"{'masked':>7}")
        for batch in args.batch:
            runs: dict[str, list[float]] = {"none": [], "json": []}
            shares = []
            for repeat in range(args.repeat):
                order = ("none", "json") if repeat % 2 == 0 else ("json", "none")
                for mode in order:
                    rate, outputs = time_batch(engine, batch, args.tokens,
                                               spec if mode == "json" else None, repeat)
                    runs[mode].append(rate)
                    if mode == "json":
                        shares.append(masked_share(grammars, spec, outputs))
                        sample = max(outputs, key=len)
            ratio = statistics.median(a / b for a, b in zip(runs["json"], runs["none"],
                                                             strict=True))
            print(f"{batch:>5} {statistics.median(runs['none']):>10.1f} "
                  f"{statistics.median(runs['json']):>10.1f} {ratio:>9.3f} "
                  f"{statistics.median(shares):>7.0%}")
        print("mask cost per row (microseconds, median):")
        for name, value in mask_costs(grammars, spec, sample, args.repeat).items():
            print(f"  {name:<24} {value:>8.1f}")
    finally:
        cluster.close(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
