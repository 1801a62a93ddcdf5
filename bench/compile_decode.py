"""--compile against eager on CPU at TP1: start-up compile time and decode tokens/s.

    python bench/compile_decode.py [--model tiny default ...] [--tokens 48] [--repeat 3]
                                   [--max-model-len 512] [--threads 1]

For each model (what launch.serve's --model takes; ``default`` is its default, SmolLM2; one
that does not resolve here is reported and skipped) it builds the eager rank and the
compiled one (--compile: the forward over padded token buckets, the sample phase over padded
row buckets and the reduce phase, each as torch.compile graphs) in this process, and times
batches of greedy requests with logprobs=20 (batch 1 and 16), eager and compiled back to
back within every repeat, the order alternating. Prints the seconds that building the
compiled rank adds (Inductor's compile, cold: its cache is pointed at a fresh directory) and
the median tokens/s and their ratio. Prefill is subtracted as in bench/decode.py.
--max-model-len bounds the KV caches (two engines per model in one process; the default 512 keeps
SmolLM2's under 1 GB each).
--threads sets torch's threads before anything compiles (Inductor bakes the count into its
kernels' OpenMP regions); 1, as bench/decode.py: on a shared 2-core machine a 2-thread region
waits for a descheduled worker, and the compiled forward's many small regions paid that
tens of times a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(model_dir: Path, compile: bool, max_model_len: int):
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    config = RuntimeConfig(model_dir=model_dir, capacity=16, max_model_len=max_model_len,
                           compile=compile)
    start = time.perf_counter()
    step = load_rank(config, None)
    return build_engine(config, step).start(), time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", nargs="*", default=["tiny", "default"])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    from bench.decode import time_batch
    from helios_logprobs.launch.model_source import resolve_model

    print(f"TP1 CPU, {args.threads} thread(s), logprobs=20, {args.tokens} tokens per request,"
          f" median of {args.repeat}")
    print(f"{'model':>10} {'batch':>5} {'eager tok/s':>11} {'compiled':>9} {'ratio':>6}"
          f" {'compile s':>9}")
    for name in args.model:
        try:
            model_dir = resolve_model(None if name == "default" else name, None).path
        except (SystemExit, Exception) as exc:  # noqa: BLE001 (reported, not hidden)
            print(f"{name:>10} not available here: {exc}")
            continue
        eager, eager_s = build(model_dir, False, args.max_model_len)
        compiled, compiled_s = build(model_dir, True, args.max_model_len)
        try:
            for engine in (eager, compiled):
                time_batch(engine, 2, 8, 20)
            for batch in (1, 16):
                runs = {False: [], True: []}
                for repeat in range(args.repeat):
                    order = (False, True) if repeat % 2 == 0 else (True, False)
                    for which in order:
                        engine = compiled if which else eager
                        runs[which].append(time_batch(engine, batch, args.tokens, 20))
                e, c = statistics.median(runs[False]), statistics.median(runs[True])
                print(f"{name:>10} {batch:>5} {e:>11.1f} {c:>9.1f} {c / e:>6.3f}"
                      f" {compiled_s - eager_s:>9.1f}")
        finally:
            eager.shutdown()
            compiled.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
