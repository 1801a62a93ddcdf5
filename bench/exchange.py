"""Bytes exchanged by the sharded logprob reduction vs a full-row all-gather of the logits.

Part 1 (arithmetic): per position per rank, the reduction sends EXCHANGE1_WORDS +
EXCHANGE2_WORDS int32 words (two fixed-width all-gathers); the baseline sends the rank's
logit shard of ceil(vocab / tp) values, in bf16 or fp32. Every rank receives tp times what
each rank sends, so the ratios hold for received bytes as well.

Part 2 (measured, gloo, 4 local processes, 32 positions): two WordExchange gathers of widths
2 and 129 vs one all-gather of a [32, vocab / 4] bf16 shard. One iteration = a barrier, then
the operation; its time is the slowest rank's; it prints the median and the minimum over
iterations (the minimum is the less noisy number on a shared machine).

Run: ``.venv/bin/python bench/exchange.py`` (or ``python -m bench.exchange``).
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from helios_logprobs.collectives.exchange import WordExchange, all_gather_flat
from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS

VOCABS = (32_000, 151_936, 262_144)
TPS = (2, 4, 8)
WORLD = 4
POSITIONS = 32
WARMUP = 5
ITERS = {"sharded": 60, "full": 20}
SHARDED_BYTES = (EXCHANGE1_WORDS + EXCHANGE2_WORDS) * 4


def byte_table() -> str:
    head = (f"{'vocab':>8} {'tp':>3} {'shard':>7} | {'ours sent':>9} {'ours recv':>9} | "
            f"{'bf16 sent':>9} {'fp32 sent':>9} | {'bf16/ours':>9} {'fp32/ours':>9}")
    rows = [head, "-" * len(head)]
    for vocab in VOCABS:
        for tp in TPS:
            shard = math.ceil(vocab / tp)
            bf16, fp32 = shard * 2, shard * 4
            rows.append(
                f"{vocab:>8} {tp:>3} {shard:>7} | {SHARDED_BYTES:>9} {SHARDED_BYTES * tp:>9} | "
                f"{bf16:>9} {fp32:>9} | {bf16 / SHARDED_BYTES:>8.1f}x {fp32 / SHARDED_BYTES:>8.1f}x"
            )
    return "\n".join(rows)


def _timed(op, iters: int) -> list[float]:
    times = []
    for i in range(WARMUP + iters):
        dist.barrier()
        start = time.perf_counter()
        op()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def _slowest(times: list[float]) -> tuple[float, float]:
    """(median, minimum) over iterations of the slowest rank's time."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    slowest = [max(per_rank) for per_rank in zip(*every, strict=True)]
    return statistics.median(slowest), min(slowest)


def _rank_main(rank: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        gen = torch.Generator().manual_seed(rank)
        ex1 = WordExchange(group, POSITIONS, EXCHANGE1_WORDS)
        ex2 = WordExchange(group, POSITIONS, EXCHANGE2_WORDS)
        ex1.send.copy_(torch.randint(-2**31, 2**31 - 1, ex1.send.shape, generator=gen))
        ex2.send.copy_(torch.randint(-2**31, 2**31 - 1, ex2.send.shape, generator=gen))

        def sharded() -> None:
            ex1.gather()
            ex2.gather()

        ours = _slowest(_timed(sharded, ITERS["sharded"]))
        out = {}
        for vocab in VOCABS:
            shard = torch.randn(POSITIONS, math.ceil(vocab / WORLD), generator=gen)
            shard = shard.to(torch.bfloat16)
            full = shard.new_empty(WORLD * POSITIONS, shard.shape[1])

            def gather_rows(full=full, shard=shard) -> None:
                all_gather_flat(full, shard, dist.group.WORLD)

            out[vocab] = _slowest(_timed(gather_rows, ITERS["full"]))
        if rank == 0:
            results.put((ours, out))
    finally:
        dist.destroy_process_group()


def measure() -> tuple[tuple[float, float], dict[int, tuple[float, float]]]:
    ctx = mp.get_context("spawn")
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, master.port, results), daemon=True)
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        return results.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def main() -> None:
    print(f"Bytes per position per rank: sharded reduction = ({EXCHANGE1_WORDS} + "
          f"{EXCHANGE2_WORDS}) int32 words = {SHARDED_BYTES} B sent, tp x that received;")
    print("full-row all-gather = the rank's logit shard (ceil(vocab / tp) values).\n")
    print(byte_table())
    print(f"\nMeasured on gloo, TP{WORLD} ({WORLD} local processes), {POSITIONS} positions, "
          f"slowest rank per iteration, median and min ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start):")
    (ours, ours_min), full = measure()
    print(f"  sharded: 2 WordExchange gathers (widths {EXCHANGE1_WORDS}, {EXCHANGE2_WORDS}): "
          f"median {ours * 1e3:7.3f} ms, min {ours_min * 1e3:7.3f} ms  "
          f"({POSITIONS * SHARDED_BYTES} B sent per rank)")
    for vocab, (median, fastest) in full.items():
        width = math.ceil(vocab / WORLD)
        print(f"  vocab {vocab:>7}: all-gather [{POSITIONS}, {width}] bf16: median "
              f"{median * 1e3:7.3f} ms, min {fastest * 1e3:7.3f} ms  "
              f"({POSITIONS * width * 2} B sent per rank); median ratio {median / ours:5.1f}x, "
              f"min ratio {fastest / ours_min:5.1f}x")

if __name__ == "__main__":
    main()
