"""HTTP serving throughput with and without logprobs, on loopback.

Starts its own server (the embedded tiny model unless --model or --large-vocab is given; --url
uses a running one), then runs the same workload with 16 concurrent clients (--concurrency) in
three modes: no logprobs, logprobs=0 and logprobs=20 (Completions; --chat uses Chat Completions
with top_logprobs). The modes run back to back within each of --repeat rounds (their order
rotating), so that load from other processes affects them alike. Prints the median
requests/s, generated tokens/s and response bytes per request of each mode; "tok/s x" is the
median over rounds of the mode's tokens/s divided by the no-logprobs run of the same round
(throughput here drifts by 20% within seconds), "quartiles" that ratio's first and third
quartiles over rounds (how far one round's ratio can be trusted), "of medians" the ratio of
the medians, "steal" the median share of the host's CPU time that the hypervisor gave to
other guests during the mode's runs (bench/host.py; "-" off Linux). A 5% cost needs ~10
rounds to show against this machine's noise, and no number of rounds helps while steal is
high: rerun then.

    python -m bench.serve [--large-vocab] [--requests 256] [--max-tokens 32] [--stream] [--chat]
        [--repeat 3] [--concurrency 16 --capacity 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import server
from bench.host import cpu_counters, share_text, steal_share
from bench.large_vocab import large_vocab_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    name: str
    seconds: float
    requests: int
    tokens: int
    bytes: int
    steal: float | None = None
    """The share of the host's CPU time stolen by the hypervisor during the run."""

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def bytes_per_response(self) -> float:
        return self.bytes / self.requests


MODES = (("no logprobs", None), ("logprobs=0", 0), ("logprobs=20", 20))


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    if args.large_vocab:
        args.model = str(large_vocab_model())
    model = ["--model", args.model] if args.model else []
    return server.start_server(["--capacity", str(args.capacity), *model])


def request_body(args: argparse.Namespace, model: str, i: int, logprobs: int | None) -> dict:
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": 1.0, "seed": i,
              "ignore_eos": True, "stream": args.stream}
    if args.stream:
        common["stream_options"] = {"include_usage": True}
    if args.chat:
        body = {**common, "messages": [{"role": "user", "content": f"Tell story {i}."}]}
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        return body
    body = {**common, "prompt": f"Once upon a time, story number {i}"}
    if logprobs is not None:
        body["logprobs"] = logprobs
    return body


async def run(args: argparse.Namespace, url: str, model: str, name: str,
              logprobs: int | None) -> Result:
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    totals = {"tokens": 0, "bytes": 0}

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            response = await client.post(path, json=request_body(args, model, i, logprobs))
            response.raise_for_status()
            body = response.content
            totals["bytes"] += len(body)
            if args.stream:
                last = [b for b in body.split(b"\n\n") if b.startswith(b"data: {")][-1]
                usage = httpx.Response(200, content=last[6:]).json()["usage"]
            else:
                usage = response.json()["usage"]
            totals["tokens"] += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        counters, start = cpu_counters(), time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        seconds, stolen = time.perf_counter() - start, steal_share(counters, cpu_counters())
    return Result(name, seconds, args.requests, totals["tokens"], totals["bytes"], stolen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="use a running server instead")
    parser.add_argument("--model", default="tiny",
                        help="what launch.serve's --model takes (default: the embedded tiny model)")
    parser.add_argument("--large-vocab", action="store_true",
                        help="bench.large_vocab's random 151,936-id checkpoint (built, cached)")
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        asyncio.run(run(warm, url, model, "warmup", 20))
        runs: dict[str, list[Result]] = {name: [] for name, _ in MODES}
        for repeat in range(args.repeat):
            for name, lp in MODES[repeat % 3:] + MODES[: repeat % 3]:
                runs[name].append(asyncio.run(run(args, url, model, name, lp)))
    finally:
        if proc is not None:
            server.stop_server(proc)
    results = [median_result(name, runs[name]) for name, _ in MODES]
    base = results[0]
    kind = "chat" if args.chat else "completions"
    print(f"{kind}, stream={args.stream}, {args.concurrency} clients, {args.requests} requests, "
          f"max_tokens={args.max_tokens}, median of {args.repeat}")
    print(f"{'run':<13}{'req/s':>9}{'tok/s':>10}{'bytes/resp':>12}"
          f"{'tok/s x':>9}{'quartiles':>13}{'of medians':>12}{'bytes x':>9}{'steal':>7}")
    for r in results:
        paired = [a.tps / b.tps for a, b in zip(runs[r.name], runs[base.name], strict=True)]
        low, middle, high = (statistics.quantiles(paired, n=4, method="inclusive")
                             if len(paired) > 1 else paired * 3)
        print(f"{r.name:<13}{r.rps:>9.2f}{r.tps:>10.1f}{r.bytes_per_response:>12.0f}"
              f"{middle:>9.3f}{f'{low:.3f}-{high:.3f}':>13}{r.tps / base.tps:>12.3f}"
              f"{r.bytes_per_response / base.bytes_per_response:>9.2f}"
              f"{median_steal(runs[r.name]):>7}")


def median_steal(results: list[Result]) -> str:
    shares = [r.steal for r in results if r.steal is not None]
    return share_text(statistics.median(shares) if shares else None)


def median_result(name: str, results: list[Result]) -> Result:
    """The run of median duration (same requests and tokens in every run of a mode)."""
    ordered = sorted(results, key=lambda r: r.seconds)
    middle = ordered[len(ordered) // 2]
    seconds = statistics.median(r.seconds for r in results)
    return Result(name, seconds, middle.requests, middle.tokens, middle.bytes)


if __name__ == "__main__":
    main()
