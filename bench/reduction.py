"""Packed logprob reduction vs the full-row baseline, same inputs, same process.

    python bench/reduction.py [--backend torch|triton] [--repeat N] [--threads T]
    (or python -m bench.reduction ...)

Baseline: ``lp = logits.float().log_softmax(-1)``, ``lp.topk(20)`` and ``lp.gather`` of the
chosen token: what a server does without a tiled reduction. Ours: ``kernels.reduce_logprobs``
(K = 20, every row requested) into a preallocated output; "prepared" is the same backend
called the way the runtime calls it (a RowRequest built once, no per-call argument
validation: kernels/sharded.py's driver and ranks/step/reduce.py). Inputs: bf16 logits
~ N(0, 3^2), rows in {1, 32, 256} x vocabulary in {32,000, 151,936}.

Time: median of N calls after two warm-up calls, baseline and ours alternating so that
drift (other processes, frequency) hits both alike. On CUDA, CUDA events around each call;
on CPU wall time, or with ``--clock cpu`` the process's CPU time (all threads), which a
busy shared machine disturbs much less than wall time.

Peak extra memory: the high-water mark of bytes allocated during one call above the level
before it (inputs and the preallocated output excluded, everything the call allocates and
frees included). On CUDA: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``. On CPU: the torch profiler with ``profile_memory=True`` records
every allocation and free of the CPU allocator with its size; the running sum of that
stream, in time order, gives the peak. (Python objects and allocator caching are not
counted; they are the same for both sides and small.) The torch backend keeps its launch-1
buffers (at most one slab of FP32 scratch, kernels/cpu/lean_stats.py StatsPlan) between
calls: "kept" reports them, and the memory ratio counts them.

CUDA also reports achieved bandwidth: logit bytes / time for ours and the baseline, next to
a device-to-device copy of the same logits measured in the same run (read + write bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from helios_logprobs.kernels.api import reduce_logprobs, row_request
from helios_logprobs.kernels.backends import require_triton_device

K = 20


def baseline(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, ...]:
    lp = logits.float().log_softmax(-1)
    values, ids = lp.topk(K, dim=-1)
    return values, ids, lp.gather(1, chosen.unsqueeze(1))


def time_pair(
    fns: list[Callable[[], object]], repeat: int, device: torch.device, clock=time.perf_counter
) -> list[float]:
    """Median seconds per call of each fn, calls interleaved."""
    for fn in fns:
        fn()
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[i].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = clock()
                fn()
                samples[i].append(clock() - t0)
    return [statistics.median(s) for s in samples]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the CPU profiler of some torch builds prints two
    "USDT ... profiler_start/stop" lines per session there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measure(
    backend: str,
    repeat: int,
    device: torch.device,
    rows: int,
    vocab: int,
    g: torch.Generator,
    clock: Callable[[], float],
) -> str:
    """One table line: the same bf16 logits through the baseline and through ours."""
    cuda = device.type == "cuda"
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(device)
    chosen = torch.randint(0, vocab, (rows,), generator=g).to(device)
    out = torch.empty(rows, 2 + 2 * 128, dtype=torch.int32, device=device)

    def ours() -> object:
        return reduce_logprobs(logits, chosen, k=K, out=out, backend=backend)

    requested = torch.ones(rows, dtype=torch.int32, device=device)
    request = row_request(chosen, None, requested, K, vocab, device)
    if backend == "torch":
        from helios_logprobs.kernels.cpu.backend import reduce_torch as prepared_backend
    else:
        require_triton_device(device)
        from helios_logprobs.kernels.triton.backend import reduce_triton as prepared_backend

    def prepared() -> object:
        return prepared_backend(logits, request, vocab, out)

    def base() -> object:
        return baseline(logits, chosen)

    fns: list[Callable[[], object]] = [base, ours, prepared]
    if cuda:
        copy = torch.empty_like(logits)
        fns.append(lambda: copy.copy_(logits))
    times = time_pair(fns, repeat, device, clock)
    mem_base = peak_extra_bytes(base, device)
    mem_ours = peak_extra_bytes(ours, device)
    kept = kept_bytes(backend)
    line = (
        f"| {rows} | {vocab:,} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} "
        f"| {times[0] / times[1]:.2f}x | {times[2] * 1e3:.3f} | {times[0] / times[2]:.2f}x "
        f"| {mem_base / 2**20:.2f} | {mem_ours / 2**20:.2f} | {kept / 2**20:.2f} "
        f"| {(mem_ours + kept) / max(mem_base, 1):.3f} |"
    )
    if cuda:
        nbytes = logits.numel() * logits.element_size()
        line += (
            f" {nbytes / times[1] / 1e9:.0f} | {nbytes / times[0] / 1e9:.0f} "
            f"| {2 * nbytes / times[3] / 1e9:.0f} |"
        )
    return line



def kept_bytes(backend: str) -> int:
    """Scratch the backend keeps between calls (this thread's launch-1 plans)."""
    if backend != "torch":
        return 0
    from helios_logprobs.kernels.cpu.lean_stats import kept_bytes as kept

    return kept()


def run(
    backend: str, repeat: int, device: torch.device, rows_list, vocab_list, clock
) -> str:
    g = torch.Generator().manual_seed(0)
    head = "| rows | vocab | baseline ms | ours ms | speedup | prepared ms | speedup "
    head += "| baseline peak MiB | ours peak MiB | ours kept MiB | memory ratio |"
    if device.type == "cuda":
        head += " ours GB/s | baseline GB/s | copy GB/s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for vocab in vocab_list:
        for rows in rows_list:
            if backend == "torch":
                from helios_logprobs.kernels.cpu.lean_stats import release_plans

                release_plans()  # "kept" then reports this configuration's buffers alone
            line = measure(backend, repeat, device, rows, vocab, g, clock)
            print(line, flush=True)
    return line


def figure(line: str) -> str:
    """The last table line in one phrase (scripts/device-check.sh's summary): rows x vocab,
    speedup of ours over the baseline, and on CUDA ours/copy achieved bandwidth."""
    cells = [c.strip() for c in line.strip("|").split("|")]
    text = f"{cells[0]} x {cells[1]}: speedup {cells[4]} over the baseline"
    if len(cells) > 12:
        text += f", {cells[11]} GB/s (a device copy: {cells[13]} GB/s)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="CPU device: wall time, or CPU time of the whole process (all threads; steadier "
        "on a shared machine)",
    )
    parser.add_argument("--figures", default=None,
                        help="write the last line's figure (one phrase) to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.backend == "triton" and device.type != "cuda":
        parser.error("--backend triton needs a CUDA device (the interpreter is for tests)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"backend={args.backend} device={device} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} repeat={args.repeat} clock={args.clock}"
    )
    last = run(args.backend, args.repeat, device, args.rows, args.vocab, clock)
    if args.figures:
        with open(args.figures, "w") as f:
            f.write(figure(last) + "\n")


if __name__ == "__main__":
    main()
