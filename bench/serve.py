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
        [--repeat 3] [--concurrency 16 --capacity 16] [--serve-arg=--api-server-count=2]
        [--root /tmp/new] [--baseline-root /tmp/old] [--baseline-arg ...] [--modes none,0,20]

With --baseline-root (a `git worktree` of another commit) or --baseline-arg, a second server
runs the same modes in every round, interleaved with the first; the last table gives each
mode's tokens/s on both, the median over rounds of their ratio, and (streaming) the median
time to first response bytes.
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
    ttft_p50: float | None = None
    """Streaming: the median time from sending a request to its first response bytes."""

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


def start_server(args: argparse.Namespace, extra: list[str],
                 root: Path | None = None) -> tuple[subprocess.Popen, str]:
    if args.large_vocab:
        args.model = str(large_vocab_model())
    model = ["--model", args.model] if args.model else []
    return server.start_server(["--capacity", str(args.capacity), *model, *extra], root=root)


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
    firsts: list[float] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = request_body(args, model, i, logprobs)
            if args.stream:
                sent, pieces = time.perf_counter(), []
                async with client.stream("POST", path, json=body) as response:
                    response.raise_for_status()
                    async for piece in response.aiter_bytes():
                        if not pieces:
                            firsts.append(time.perf_counter() - sent)
                        pieces.append(piece)
                content = b"".join(pieces)
                last = [b for b in content.split(b"\n\n") if b.startswith(b"data: {")][-1]
                usage = httpx.Response(200, content=last[6:]).json()["usage"]
            else:
                response = await client.post(path, json=body)
                response.raise_for_status()
                content = response.content
                usage = response.json()["usage"]
            totals["bytes"] += len(content)
            totals["tokens"] += usage["completion_tokens"]

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        counters, start = cpu_counters(), time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        seconds, stolen = time.perf_counter() - start, steal_share(counters, cpu_counters())
    ttft = statistics.median(firsts) if firsts else None
    return Result(name, seconds, args.requests, totals["tokens"], totals["bytes"], stolen,
                  ttft)


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
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more launch.serve argument, e.g. "
                             "--serve-arg=--api-server-count=2")
    parser.add_argument("--root", type=Path, default=None,
                        help="run the server from this checkout (a `git worktree` of a "
                             "commit) instead of this one")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="also run a second server from this checkout (a `git worktree` of "
                             "an older commit), interleaved with the first in every round")
    parser.add_argument("--baseline-arg", action="append", default=[], metavar="ARG",
                        help="launch.serve arguments of the second server (implies one)")
    parser.add_argument("--modes", default="none,0,20",
                        help="logprobs of each mode: none, 0, 20 (default all three)")
    args = parser.parse_args(argv)
    modes = [m for m in MODES if (m[1] is None and "none" in args.modes.split(","))
             or str(m[1]) in args.modes.split(",")]
    servers: dict[str, str] = {}
    procs = []
    try:
        if args.url is not None:
            servers["server"] = args.url
        else:
            proc, servers["server"] = start_server(args, args.serve_arg, args.root)
            procs.append(proc)
        if args.baseline_root is not None or args.baseline_arg:
            proc, servers["baseline"] = start_server(args, args.baseline_arg, args.baseline_root)
            procs.append(proc)
        model = httpx.get(servers["server"] + "/v1/models").json()["data"][0]["id"]
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        for url in servers.values():
            asyncio.run(run(warm, url, model, "warmup", 20))
        runs: dict[tuple[str, str], list[Result]] = {
            (s, name): [] for s in servers for name, _ in modes}
        for repeat in range(args.repeat):
            order = list(servers.items())
            order = order[repeat % len(order):] + order[: repeat % len(order)]
            for name, lp in modes[repeat % len(modes):] + modes[: repeat % len(modes)]:
                for label, url in order:
                    runs[label, name].append(asyncio.run(run(args, url, model, name, lp)))
    finally:
        for proc in procs:
            server.stop_server(proc)
    kind = "chat" if args.chat else "completions"
    print(f"{kind}, stream={args.stream}, {args.concurrency} clients, {args.requests} requests, "
          f"max_tokens={args.max_tokens}, median of {args.repeat}")
    for label in servers:
        extra = args.serve_arg if label == "server" else args.baseline_arg
        where = (args.baseline_root if label == "baseline" and args.baseline_root
                 else args.root or ROOT)
        print(f"{label}: {where} {' '.join(extra)}")
        print_modes({name: runs[label, name] for name, _ in modes})
    if len(servers) == 2:
        print(f"{'mode':<13}{'server tok/s':>14}{'baseline':>10}{'x (paired)':>12}"
              f"{'TTFT p50 ms':>13}{'baseline':>10}")
        for name, _ in modes:
            a, b = runs["server", name], runs["baseline", name]
            paired = statistics.median(x.tps / y.tps for x, y in zip(a, b, strict=True))
            ta, tb = median_result(name, a), median_result(name, b)
            print(f"{name:<13}{ta.tps:>14.1f}{tb.tps:>10.1f}{paired:>12.3f}"
                  f"{ttft_text(a):>13}{ttft_text(b):>10}")


def ttft_text(results: list[Result]) -> str:
    values = [r.ttft_p50 for r in results if r.ttft_p50 is not None]
    return f"{1000 * statistics.median(values):.0f}" if values else "-"


def print_modes(runs: dict[str, list[Result]]) -> None:
    results = [median_result(name, rs) for name, rs in runs.items()]
    base = results[0]
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
