"""Offline batch generation through the same engine the server uses.

`torchrun --nproc-per-node N -m helios_logprobs.launch.generate --requests in.json
--output out.json`

in.json: a list of {"prompt_ids": [...], "params": {SamplingParams fields}}. out.json: per
request {"tokens": [{"index", "token_id", "logprob", "alternatives": [[id, logprob], ...]}],
"finish": {...}} or {"error": "..."}; -inf logprobs are written as null-free floats (JSON
-Infinity is avoided: they become -9999.0, as on the wire).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helios_logprobs.launch.arguments import add_runtime_arguments
from helios_logprobs.launch.cluster import join
from helios_logprobs.launch.signals import Interrupted, StopSignals, env_rank, exit_process
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.outputs import EngineError


def _value(x: float) -> float:
    return -9999.0 if x == -math.inf else x


def run_one(engine, item: dict) -> dict:
    raw = dict(item.get("params", {}))
    for key in ("logit_bias",):
        if key in raw:
            raw[key] = tuple((int(t), float(b)) for t, b in raw[key])
    for key in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    try:
        params = SamplingParams(**raw)
        tokens, finish = engine.generate_sync(list(item["prompt_ids"]), params)
    except (RequestError, EngineError) as exc:
        return {"error": str(exc), "param": getattr(exc, "param", None)}
    return {
        "tokens": [
            {
                "index": t.index,
                "token_id": t.token_id,
                "logprob": None if t.logprob is None else _value(t.logprob),
                "alternatives": [[a.token_id, _value(a.logprob)] for a in t.alternatives],
            }
            for t in tokens
        ],
        "finish": {"reason": finish.reason, "stop_token_id": finish.stop_token_id},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="helios_logprobs.launch.generate", description=__doc__)
    add_runtime_arguments(p)
    p.add_argument("--requests", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    # A stop signal (any rank) fails the requests in flight and ends the job with status 1,
    # without writing the output; see launch.signals.StopSignals.
    stop = StopSignals(env_rank(), status=1).install()
    cluster = engine = pool = None
    try:
        cluster = join(args)
        if not cluster.is_coordinator:
            return cluster.run_peer(stop)
        engine = cluster.engine(stop)
        stop.on_stop(lambda: engine.fail(f"stopped ({stop.reason})"))
        print("engine ready", file=sys.stderr, flush=True)
        items = json.loads(args.requests.read_text())
        pool = ThreadPoolExecutor(max_workers=max(1, cluster.config.capacity))
        results = list(pool.map(lambda item: run_one(engine, item), items))
        if stop.requested:
            return 1
        counters = engine.executor.counters
        out = {
            "results": results,
            "counters": {k: getattr(counters, k) for k in vars(counters)},
            "healthy": engine.healthy(),
        }
        args.output.write_text(json.dumps(out, allow_nan=False))
        return 0 if engine.healthy() else 1
    except Interrupted:
        return 1
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if cluster is not None and cluster.is_coordinator:
            cluster.close(engine)


if __name__ == "__main__":
    exit_process(main())
