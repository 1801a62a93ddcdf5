"""Offline batch generation through the same engine, validation and responses as the server.

`torchrun --nproc-per-node N -m helios_logprobs.launch.generate --requests in.json
--output out.json`

in.json: a list of requests, each a Completions body (``prompt``: text or token ids), a Chat
Completions body (``messages``), or ``{"prompt_ids": [...], "params": {SamplingParams
fields}}`` (launch/offline.py says what each gets). out.json: ``{"results": [one per request,
in order], "counters": {...}, "healthy": bool}``; a refused or failed request's result is
OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, and the others
are answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helios_logprobs.launch.arguments import add_runtime_arguments
from helios_logprobs.launch.signals import Interrupted, StopSignals, env_rank, exit_process

GENERATION_CONFIG_DEFAULT = "auto"
"""As the server's --generation-config (runtime.http.protocol.defaults.FROM_MODEL)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="helios_logprobs.launch.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_arguments(p)
    p.add_argument("--requests", type=Path, required=True, help="a JSON list of requests")
    p.add_argument("--output", type=Path, required=True, help="where the results go (JSON)")
    p.add_argument("--generation-config", default=GENERATION_CONFIG_DEFAULT,
                   help="sampling defaults for fields a request leaves unset, as the "
                        "server's flag: 'auto', 'vllm' or a directory (default: auto)")
    return p.parse_args(argv)


async def _answer_all(engine, assets, items: list, threads: int) -> list[dict]:
    from helios_logprobs.launch.offline import answer_all

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=threads))
    return await answer_all(engine, assets, items)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A stop signal (any rank) fails the requests in flight and ends the job with status 1,
    # without writing the output; see launch.signals.StopSignals.
    stop = StopSignals(env_rank(), status=1).install()
    cluster = engine = None
    try:
        from helios_logprobs.launch.cluster import join
        from helios_logprobs.runtime.http.assets import ModelAssets

        cluster = join(args)
        if not cluster.is_coordinator:
            return cluster.run_peer(stop)
        engine = cluster.engine(stop)
        stop.on_stop(lambda: engine.fail(f"stopped ({stop.reason})"))
        names = [engine.info.model_name, *(args.served_model_name or [])[1:]]
        model_dir = cluster.config.model_dir
        assets = ModelAssets(model_dir, names, engine.info.vocab_size, args.generation_config
                             ) if (model_dir / "tokenizer.json").is_file() else None
        print("engine ready", file=sys.stderr, flush=True)
        items = json.loads(args.requests.read_text())
        if not isinstance(items, list):
            items = [items]
        threads = max(4, cluster.config.capacity)
        results = asyncio.run(_answer_all(engine, assets, items, threads))
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
        if cluster is not None and cluster.is_coordinator:
            cluster.close(engine)


if __name__ == "__main__":
    exit_process(main())
