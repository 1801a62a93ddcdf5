"""Serve a model: `torchrun --nproc-per-node N -m helios_logprobs.launch.serve [--model DIR]
[--port P]`.

Without torchrun it runs one rank (TP1) in this process. Rank 0 is the coordinator: it runs
the engine and the HTTP server; every other rank runs the peer loop.

Rank 0 writes these lines to stderr (every other rank is silent unless something fails):
``helios: serving <model> at http://<host>:<port>/v1 (TP=<n>, logprobs: K=<k>|off, prompt
scoring: on|off)`` once uvicorn listens, followed by one capacity line (``helios: frames
<x> MiB device (...), <y> MiB host; KV capacity <slots> x <len> tokens (...); queue limit
<n>``), and ``helios: shutting down (<reason>)`` on SIGINT,
SIGTERM or SIGHUP to any rank (``SIGINT``; ``SIGTERM on rank 1`` when only a peer got it).
Then uvicorn stops listening, requests in flight get DRAIN_S to finish before they fail, the
peers get Shutdown, and every rank exits with status 0 (launch.signals.StopSignals). A bare
`torchrun` still prints its own SignalException traceback on SIGINT; `helios-serve --tp N`
(launch.wrapper) runs torchrun quietly.
"""

from __future__ import annotations

import os
import signal


def _stop_while_importing(signum: int, frame: object) -> None:
    """A stop signal before main() installs StopSignals: nothing to clean up yet."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"helios: shutting down ({signal.Signals(signum).name})\n".encode())
    os._exit(0)


if __name__ == "__main__":  # before the imports below, which take seconds (torch)
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _stop_while_importing)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import uvicorn  # noqa: E402

from helios_logprobs.launch.arguments import add_runtime_arguments  # noqa: E402
from helios_logprobs.launch.cluster import join  # noqa: E402
from helios_logprobs.launch.heap import settle_heap  # noqa: E402
from helios_logprobs.launch.signals import Interrupted, StopSignals, env_rank, exit_process, say  # noqa: E402
from helios_logprobs.ranks.model import ModelConfigError, UnsupportedModelError, WeightLoadError  # noqa: E402
from helios_logprobs.runtime.http.protocol.defaults import (  # noqa: E402
    FROM_MODEL,
    GenerationConfigError,
    load_sampling_defaults,
)

CHECKPOINT_ERRORS = (ModelConfigError, UnsupportedModelError, WeightLoadError,
                     GenerationConfigError)
"""What a checkpoint directory can be refused with at start-up."""

DRAIN_S = 3.0
"""How long requests in flight may still finish after a stop (see serve_http)."""
GRACEFUL_S = 5
"""uvicorn's timeout_graceful_shutdown: it cancels what is still running after this long."""


MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""--max-request-bytes' default (runtime.http.protocol.limits.DEFAULT_MAX_REQUEST_BYTES)."""
MIB = 1024 * 1024


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="helios_logprobs.launch.serve", description=__doc__)
    add_runtime_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-request-bytes", type=_positive, default=MAX_REQUEST_BYTES,
                   help="largest request body in bytes; a larger one gets HTTP 413 "
                        "(default: 8 MiB)")
    p.add_argument("--generation-config", default=FROM_MODEL,
                   help="sampling defaults for fields a request leaves unset (temperature, "
                        "top_p, top_k, min_p, repetition_penalty; max_new_tokens caps "
                        "max_tokens): 'auto' reads the model's generation_config.json, 'vllm' "
                        "uses neutral ones, or a directory holding generation_config.json")
    p.add_argument("--max-queued-requests", type=_positive, default=None,
                   help="engine requests (one per choice) waiting or running at once; beyond "
                        "it HTTP 429 with Retry-After (default: 4 x --capacity)")
    return p.parse_args(argv)


def ready_line(model: str, host: str, port: int, tp: int, max_logprobs: int,
               prompt_scoring: bool) -> str:
    """The start-up line (after ``helios: ``)."""
    where = f"[{host}]" if ":" in host else host
    logprobs = f"K={max_logprobs}" if max_logprobs > 0 else "off"
    scoring = "on" if prompt_scoring else "off"
    return (f"serving {model} at http://{where}:{port}/v1 "
            f"(TP={tp}, logprobs: {logprobs}, prompt scoring: {scoring})")


def capacity_line(engine, world: int, queue_limit: int | None) -> str:
    """One line (after ``helios: ``) of what the coordinator's frames and each rank's KV cache
    hold, from ranks.capacity.sizing (the figures launch.capacity prints)."""
    from helios_logprobs.ranks.capacity.sizing import frame_bytes, rank_sizing

    step = engine.step
    frames = frame_bytes(step.config)
    rank = rank_sizing(step.model.config, step.config, world, 0, step.model.dtype)
    config = step.config
    queue = "unbounded" if queue_limit is None else str(queue_limit)
    return (f"frames {frames.device / MIB:.1f} MiB device (completion "
            f"{frames.completion / MIB:.1f}, scored {frames.scored / MIB:.1f}), "
            f"{frames.host / MIB:.1f} MiB host; KV capacity {config.capacity} x "
            f"{config.max_seq_len} tokens ({rank.kv_cache_bytes / MIB:.1f} MiB per rank); "
            f"queue limit {queue}")


class HttpServer(uvicorn.Server):
    """uvicorn that calls ``on_ready(port)`` once it listens and leaves the signals to
    StopSignals (uvicorn's own handlers would re-raise SIGINT as KeyboardInterrupt)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready(self.servers[0].sockets[0].getsockname()[1])


def serve_http(app, engine, host: str, port: int, stop: StopSignals,
               on_ready: Callable[[int], None]) -> bool:
    """Run uvicorn in this (main) thread until ``stop`` is requested; returns whether the
    engine was healthy then.

    A stop closes the listening socket at once; requests in flight get DRAIN_S to finish,
    then the engine fails them (a stream ends with an error event), before uvicorn's own
    GRACEFUL_S would cancel them mid-response. A forced stop fails them at once."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_S,
        lifespan="off",
        loop="asyncio",  # uvloop would take over signal.set_wakeup_fd (see StopSignals)
    )
    server = HttpServer(config, on_ready)
    healthy_at_stop: list[bool] = []

    def fail_in_flight() -> None:
        engine.fail("the server is shutting down")

    def exit_now() -> None:
        healthy_at_stop.append(engine.healthy())
        server.should_exit = True
        drain = threading.Timer(DRAIN_S, fail_in_flight)
        drain.daemon = True
        drain.start()

    def force() -> None:
        fail_in_flight()
        server.force_exit = True

    stop.on_stop(exit_now)
    stop.on_force(force)
    stop.serving()
    server.run()
    return healthy_at_stop[0] if healthy_at_stop else engine.healthy()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopSignals(env_rank()).install()
    cluster = engine = None
    try:
        if args.model is not None:  # (a bad generation_config.json fails before the weights load)
            load_sampling_defaults(args.generation_config, args.model)
        cluster = join(args)
        if not cluster.is_coordinator:
            return cluster.run_peer(stop)
        engine = cluster.engine(stop)
        from helios_logprobs.runtime.http.server import create_app

        app = create_app(engine, cluster.config.model_dir, engine.info.model_name,
                         max_request_bytes=args.max_request_bytes,
                         max_queued_requests=args.max_queued_requests,
                         generation_config=args.generation_config)
        info, world = engine.info, cluster.world
        try:
            sizing = capacity_line(engine, world, app.state.admission.limit)
        except Exception as exc:  # noqa: BLE001 - a report, never a reason not to serve
            sizing = f"capacity summary unavailable ({type(exc).__name__}: {exc})"

        def on_ready(port: int) -> None:
            if not stop.requested:
                say(ready_line(info.model_name, args.host, port, world, info.max_logprobs,
                               info.prompt_logprobs))
                say(sizing)

        settle_heap()  # the app's objects too
        healthy = serve_http(app, engine, args.host, args.port, stop, on_ready)
        return 0 if healthy else 1
    except Interrupted:
        return 0
    except CHECKPOINT_ERRORS as exc:  # one line naming the file, buffer or field, no traceback
        say(f"error: {exc}")
        return 2
    except SystemExit as exc:  # uvicorn could not start (e.g. the port is taken)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if cluster is not None and cluster.is_coordinator:
            cluster.close(engine)


if __name__ == "__main__":
    exit_process(main())
