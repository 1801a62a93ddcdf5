"""The engine core's per-step host time for a step's outputs: read the frame, hand each
request's tokens to its API server's StepPacker, take the StepOutputs and encode it (what the
core does between the step and the socket). This tree's path against a baseline commit's,
loaded into the same process (its changed modules under other names), interleaved, with
the same frames and requests; medians of per-round ratios.

    .venv/bin/python -m bench.core_step --baseline 0020f18
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from helios_logprobs.collectives.codec import encode
from helios_logprobs.ranks.contract.abi6 import FinishReason, Kind
from helios_logprobs.ranks.contract.completion import CompletionOutputs, write_record
from helios_logprobs.runtime.engine.executor import HostFrame
from helios_logprobs.runtime.engine.frame_reader import read_frame
from helios_logprobs.runtime.frontend.messages import CoreStats
from helios_logprobs.runtime.frontend.packing import StepPacker

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 151_936
STATS = CoreStats(True, 0, 64, 0.5, {"frames_copied": 1})
# (module path in the tree, what the baseline's copy is imported as); in dependency order.
BASELINE_MODULES = (
    ("runtime/engine/decoding/position.py", "helios_logprobs.runtime.engine.decoding.position"),
    ("runtime/engine/decoding/frame.py", "helios_logprobs.runtime.engine.decoding.frame"),
    ("runtime/engine/frame_reader.py", "helios_logprobs.runtime.engine.frame_reader"),
    ("runtime/frontend/packing.py", "helios_logprobs.runtime.frontend.packing"),
)


def load_baseline(commit: str) -> dict[str, types.ModuleType]:
    """The baseline's versions of the changed modules, each importing the others' baseline
    versions (every other module is this tree's)."""
    loaded: dict[str, types.ModuleType] = {}
    for path, name in BASELINE_MODULES:
        source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        for _, other in BASELINE_MODULES:
            if other in loaded:
                source = source.replace(f"{other} import", f"_baseline.{other} import")
        module = types.ModuleType(f"_baseline.{name}")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)  # noqa: S102
        loaded[name] = module
    return loaded


@dataclass
class FakeSpec:
    wants_logprobs: bool
    logprob_token_ids: tuple[int, ...] = ()
    stop_entry: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class FakeParams:
    logprobs: int | None


@dataclass
class FakeRequest:
    """What the frame reader reads of a scheduler Request."""

    slot: int
    ordinal: int
    spec: FakeSpec
    params: FakeParams
    epoch: int = 1
    proposals: tuple[int, ...] = ()
    lane: object = None
    generated: list[int] = field(default_factory=list)

    @property
    def wants_logprobs(self) -> bool:
        return self.spec.wants_logprobs


def make_step(batch: int, logprobs: int | None, rng: np.random.Generator):
    """One decode step's host frame (one token per request, every 8th finishing) and its
    requests; ``logprobs`` None: no logprobs."""
    outputs = CompletionOutputs.allocate(batch, 1)
    frame = outputs.frame(0)
    records, payload = frame.records, frame.payload
    requests = []
    for slot in range(batch):
        token = int(rng.integers(0, VOCAB))
        write_record(records, slot, epoch=1, ordinal=slot + 1, kind=Kind.SAMPLE, tokens=(token,),
                     submission=5, finish_reason=int(FinishReason.LENGTH) if slot % 8 == 7 else 0)
        row = payload[slot, 0]
        row[0] = token
        row[1] = int(np.float32(-rng.exponential()).view(np.int32))
        ids = rng.choice(VOCAB, size=(row.shape[0] - 2) // 2, replace=False)
        values = np.sort(-rng.exponential(size=len(ids)).astype(np.float32))[::-1]
        row[2::2] = torch.from_numpy(ids.astype(np.int32))
        row[3::2] = torch.from_numpy(values.copy().view(np.int32))
        spec = FakeSpec(logprobs is not None)
        requests.append(FakeRequest(slot, slot + 1, spec, FakeParams(logprobs)))
    width = (payload.shape[2] - 2) // 2
    host = HostFrame(5, 0, records.numpy(), payload.numpy(), tuple(range(batch)), width)
    return host, requests


def baseline_step(modules, host, requests, lock) -> bytes:
    """The baseline's core path (its Engine._deliver and CoreEndpoint.collect, per event)."""
    outcomes = modules["helios_logprobs.runtime.engine.frame_reader"].read_frame(
        host, requests, VOCAB)
    packer = modules["helios_logprobs.runtime.frontend.packing"].StepPacker()
    for request in requests:
        outcome = outcomes[request.ordinal]
        events = list(outcome.tokens) + ([outcome.finish] if outcome.finish else [])
        with lock:
            for event in events:
                packer.add(request.ordinal, event)
        request.generated.extend(token.token_id for token in outcome.tokens)
        del request.generated[:]
    return encode(packer.take(STATS))


def current_step(host, requests, lock) -> bytes:
    """This tree's core path (Engine._deliver, RemoteSink.put_rows, CoreEndpoint.collect)."""
    frame, outcomes = read_frame(host, requests, VOCAB)
    packer = StepPacker()
    token_ids = frame.token_ids.tolist()
    for request in requests:
        outcome = outcomes[request.ordinal]
        with lock:
            packer.add_rows(request.ordinal, frame, outcome.start, outcome.stop)
        request.generated.extend(token_ids[outcome.start:outcome.stop])
        if outcome.finish is not None:
            with lock:
                packer.add(request.ordinal, outcome.finish)
        del request.generated[:]
    return encode(packer.take(STATS))


def timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200, help="steps timed per round")
    args = parser.parse_args()
    modules = load_baseline(args.baseline)
    lock = threading.Lock()
    rng = np.random.default_rng(0)
    print(f"engine core host time per step (read frame, pack, encode); baseline "
          f"{args.baseline}; median of {args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'batch':>5} {'logprobs':>8} {'baseline us':>12} {'now us':>8} {'now/base':>9}")
    for batch in args.batches:
        for logprobs in (None, 0, 20):
            host, requests = make_step(batch, logprobs, rng)
            old = functools.partial(baseline_step, modules, host, requests, lock)
            new = functools.partial(current_step, host, requests, lock)
            old(), new()
            olds, news, ratios = [], [], []
            for _ in range(args.rounds):
                a, b = timed(old, args.steps), timed(new, args.steps)
                olds.append(a)
                news.append(b)
                ratios.append(b / a)
            label = "none" if logprobs is None else str(logprobs)
            print(f"{batch:>5} {label:>8} {statistics.median(olds) * 1e6:>12.1f} "
                  f"{statistics.median(news) * 1e6:>8.1f} {statistics.median(ratios):>9.3f}")


if __name__ == "__main__":
    main()
