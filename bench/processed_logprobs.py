"""--logprobs-mode processed_logprobs and entropy against raw logprobs, at TP1 on CPU.

    python -m bench.processed_logprobs [--model tiny|default|DIR] [--tokens 32] [--repeat 5]

Part 1, decode tokens/s: two engines in this process on the same checkpoint, one built with
raw_logprobs (the default) and one with processed_logprobs, serve the same batches (batch 1
and 16, 4-token prompts, temperature 0.8, top-k 50, top-p 0.9, a seed, logprobs=5), and the
processed engine once more with ``return_entropy`` on every request, the three back to back
within every repeat (their order rotating). Prefill is excluded (a batch of one-token
requests is timed and subtracted). Prints each one's median tokens/s and the medians over
repeats of processed / raw and processed + entropy / raw in the same repeat. ``default`` is
launch.serve's default model, SmolLM2-135M (its Q4_1 GGUF). A processed engine samples every row
through the scratch (the capture-safe path, which the reduction then reads) where a raw one
lets compiled code pick temperature rows from the raw logits on the CPU.

Part 2, the reduction with entropy: the six-launch driver's TP1 call over [16, vocab] FP32
rows (SmolLM2's 49,152 and Qwen2's 151,936 lanes), with and without ``entropy_out`` (one
more word of exchange 1 at TP > 1; at TP1 its statistics pass over the row), medians and
their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

BATCHES = (1, 16)
MODES = ("raw_logprobs", "processed_logprobs")
RUNS = (("raw", MODES[0], False), ("processed", MODES[1], False),
        ("+entropy", MODES[1], True))
"""(column, engine's --logprobs-mode, return_entropy) timed in every repeat."""


def build(model_dir, mode: str, capacity: int):
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    config = RuntimeConfig(model_dir=model_dir, capacity=capacity, logprobs_mode=mode)
    return build_engine(config, load_rank(config, None))


def time_batch(engine, batch: int, tokens: int, repeat: int, entropy: bool = False) -> float:
    """Decode tokens/s of one batch (prefill and the first token subtracted)."""
    from helios_logprobs.runtime.engine.client import SamplingParams

    def jobs(max_tokens: int):
        return [([5 + i, 6, 7, 8], SamplingParams(
            max_tokens=max_tokens, temperature=0.8, top_k=50, top_p=0.9, seed=100 * repeat + i,
            ignore_eos=True, logprobs=5, return_entropy=entropy)) for i in range(batch)]

    start = time.perf_counter()
    engine.run_offline(jobs(1))
    first = time.perf_counter() - start
    start = time.perf_counter()
    engine.run_offline(jobs(tokens))
    total = time.perf_counter() - start
    return batch * (tokens - 1) / max(total - first, 1e-9)


def decode_part(model_dir, tokens: int, repeats: int) -> None:
    engines = {mode: build(model_dir, mode, max(BATCHES)) for mode in MODES}
    for engine in engines.values():
        time_batch(engine, 2, 4, 0)  # warm-up
    print(f"decode tokens/s, TP1, median of {repeats}, {tokens} tokens per request")
    print(f"{'batch':>5} " + " ".join(f"{label:>10}" for label, _, _ in RUNS)
          + f" {'proc/raw':>9} {'+ent/raw':>9}")
    for batch in BATCHES:
        runs: dict[str, list[float]] = {label: [] for label, _, _ in RUNS}
        for repeat in range(repeats):
            shift = repeat % len(RUNS)
            for label, mode, entropy in RUNS[shift:] + RUNS[:shift]:
                runs[label].append(time_batch(engines[mode], batch, tokens, repeat, entropy))
        ratios = [statistics.median(p / r for p, r in zip(runs[label], runs["raw"],
                                                          strict=True))
                  for label in ("processed", "+entropy")]
        print(f"{batch:>5} " + " ".join(f"{statistics.median(runs[label]):>10.1f}"
                                        for label, _, _ in RUNS)
              + "".join(f" {ratio:>9.3f}" for ratio in ratios))


def entropy_part(repeats: int) -> None:
    from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
    from helios_logprobs.kernels.rows import RowRequest
    from helios_logprobs.kernels.sharded import PreparedShardedReduction

    rows = 16
    print(f"reduction of {rows} rows at TP1 (torch backend), median of {repeats}")
    print(f"{'vocab':>7} {'ms':>8} {'+entropy':>9} {'ratio':>7}")
    for vocab in (49_152, 151_936):
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        request = RowRequest(x.argmax(1), torch.full((rows, MAX_TOKEN_IDS), -1,
                                                     dtype=torch.int32),
                             torch.zeros(rows, dtype=torch.int32),
                             torch.ones(rows, dtype=torch.int32), 20)
        driver = PreparedShardedReduction(None, rows, vocab, 0, vocab, vocab, "torch", "cpu",
                                          repeated=True)
        out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32)
        entropy = torch.empty(rows)
        times: dict[bool, list[float]] = {False: [], True: []}
        for step in range(repeats + 1):
            for with_entropy in (False, True) if step % 2 == 0 else (True, False):
                start = time.perf_counter()
                driver(x, request, out, entropy_out=entropy if with_entropy else None)
                if step:
                    times[with_entropy].append(time.perf_counter() - start)
        plain, more = (statistics.median(times[k]) for k in (False, True))
        print(f"{vocab:>7} {1e3 * plain:>8.2f} {1e3 * more:>9.2f} {more / plain:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny",
                        help="what launch.serve's --model takes (default: the embedded tiny "
                             "model)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from helios_logprobs.launch.model_source import resolve_model

    model = None if args.model == "default" else args.model
    decode_part(resolve_model(model).path, args.tokens, args.repeat)
    entropy_part(args.repeat)


if __name__ == "__main__":
    main()
