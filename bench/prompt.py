"""Prompt scoring throughput through the HTTP server, against ordinary prefill.

Starts its own server with --prompt-logprobs, once on the embedded tiny model (vocabulary
1,031) and once on `bench.large_vocab`'s random checkpoint (the tiny model's shape, Qwen's
151,936-token vocabulary; built on first use and cached), then sends the same prompts
(distinct random token-id prompts, so no run reuses another's prefix) as

* ordinary prefill: max_tokens 1, nothing scored (the baseline);
* prompt_logprobs=K, max_tokens 1 (the scores in `prompt_logprobs`);
* echo with logprobs=K, max_tokens 1 (the scores in the Completions logprobs arrays),

for K = 0 and K = 20. Prints prompt tokens/s (medians over --repeats interleaved repeats) and
the ratio to ordinary prefill measured in the same process, and response bytes per request.

    python -m bench.prompt [--prompt-len 256] [--requests 8] [--repeats 3] [--only tiny|large]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import server
from bench.large_vocab import DEFAULT_CACHE, LARGE_VOCAB, large_vocab_model

ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = 1031
"""The embedded tiny model's tokenizer (launch/tiny_model.py VOCAB_SIZE)."""

RUNS: list[tuple[str, dict]] = [
    ("ordinary prefill", {}),
    ("prompt_logprobs=0", {"prompt_logprobs": 0}),
    ("prompt_logprobs=20", {"prompt_logprobs": 20}),
    ("echo logprobs=0", {"echo": True, "logprobs": 0}),
    ("echo logprobs=20", {"echo": True, "logprobs": 20}),
]


@dataclass
class Samples:
    tokens_per_s: list[float] = field(default_factory=list)
    bytes_per_request: list[float] = field(default_factory=list)


def start_server(model: Path | None, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    serve = ["--capacity", str(args.capacity), "--max-model-len", str(args.prompt_len + 64),
             "--prompt-logprobs"]
    return server.start_server(serve + ["--model", "tiny" if model is None else str(model)])


def prompts(args: argparse.Namespace, text_vocab: int, salt: int) -> list[list[int]]:
    """Distinct random prompts of ordinary (non-special) ids."""
    rng = random.Random(salt)
    return [[rng.randrange(8, text_vocab) for _ in range(args.prompt_len)]
            for _ in range(args.requests)]


async def run(url: str, model: str, batch: list[list[int]], fields: dict,
              concurrency: int) -> tuple[float, float]:
    """(prompt tokens/s, response bytes per request) for one batch."""
    sizes: list[int] = []
    limits = httpx.Limits(max_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(prompt: list[int]) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                    "ignore_eos": True, **fields}
            async with gate:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            sizes.append(len(response.content))

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in batch))
        seconds = time.perf_counter() - start
    tokens = sum(len(p) for p in batch)
    return tokens / seconds, sum(sizes) / len(sizes)


def measure(model_dir: Path | None, args: argparse.Namespace) -> dict[str, Samples]:
    proc, url = start_server(model_dir, args)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        text_vocab = TINY_VOCAB  # ids both tokenizers share (the large one extends the tiny)
        samples = {run_name: Samples() for run_name, _ in RUNS}
        warm = prompts(argparse.Namespace(**{**vars(args), "requests": 2}), text_vocab, 10**6)
        for _, fields in RUNS:
            asyncio.run(run(url, model, warm, fields, args.concurrency))
        for repeat in range(args.repeats):
            for k, (run_name, fields) in enumerate(RUNS):
                batch = prompts(args, text_vocab, 1000 * repeat + k)
                tps, size = asyncio.run(run(url, model, batch, fields, args.concurrency))
                samples[run_name].tokens_per_s.append(tps)
                samples[run_name].bytes_per_request.append(size)
        return samples
    finally:
        server.stop_server(proc)


def report(name: str, samples: dict[str, Samples], args: argparse.Namespace) -> None:
    base = statistics.median(samples[RUNS[0][0]].tokens_per_s)
    print(f"\n{name}: {args.requests} prompts of {args.prompt_len} tokens, max_tokens 1, "
          f"{args.concurrency} concurrent, median of {args.repeats}")
    print(f"{'run':<20}{'prompt tok/s':>14}{'x ordinary':>12}{'bytes/resp':>12}")
    for run_name, s in samples.items():
        tps = statistics.median(s.tokens_per_s)
        size = statistics.median(s.bytes_per_request)
        print(f"{run_name:<20}{tps:>14.1f}{tps / base:>12.3f}{size:>12.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8, help="prompts per run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--only", choices=("tiny", "large", "smollm2"), default=None,
                        help=f"only the tiny model, only the {LARGE_VOCAB:,}-token checkpoint, "
                             "or only SmolLM2-135M-Instruct (the default model; not by default)")
    args = parser.parse_args(argv)
    targets: list[tuple[str, Path | None]] = []
    if args.only == "smollm2":
        from helios_logprobs.launch.model_source import default_gguf

        targets.append(("SmolLM2-135M-Instruct Q4_1 (vocabulary 49,152)", default_gguf()))
    elif args.only != "large":
        targets.append(("embedded tiny model (vocabulary 1,031)", None))
    if args.only in (None, "large"):
        args.cache.mkdir(parents=True, exist_ok=True)
        targets.append((f"random checkpoint, vocabulary {LARGE_VOCAB:,}",
                        large_vocab_model(args.cache)))
    for name, model_dir in targets:
        report(name, measure(model_dir, args), args)


if __name__ == "__main__":
    main()
