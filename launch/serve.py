"""Serve a model: `torchrun --nproc-per-node N -m launch.serve [--model DIR] [--port P]`.

Without torchrun it runs one rank (TP1) in this process. Rank 0 is the coordinator: it runs
the engine and the HTTP server; every other rank runs the peer loop.
"""

from __future__ import annotations

import argparse

from launch.cluster import add_runtime_arguments, exit_process, join


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch.serve", description=__doc__)
    add_runtime_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = join(args)
    if not cluster.is_coordinator:
        return cluster.run_peer()
    engine = cluster.engine()
    from runtime.http.server import create_app, serve

    app = create_app(engine, cluster.config.model_dir, engine.info.model_name)
    try:
        serve(app, args.host, args.port)
    finally:
        healthy = engine.healthy()
        cluster.close(engine)
    return 0 if healthy else 1


if __name__ == "__main__":
    exit_process(main())
