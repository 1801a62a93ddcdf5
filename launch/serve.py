"""Serve a model: `torchrun --nproc-per-node N -m helios_logprobs.launch.serve [--model DIR]
[--port P]`.

Without torchrun it runs one rank (TP1) in this process. Rank 0 is the engine core (scheduler,
step, frame copies, payload decoding); HTTP, tokenization, detokenization and the wire format
run in ``--api-server-count`` API server processes it starts (launch.api_server), sharing its
listening socket; every other rank runs the peer loop.

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

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

import uvicorn  # noqa: E402

from helios_logprobs.launch.heap import settle_heap  # noqa: E402
from helios_logprobs.launch.serve_options import parse_serve_args  # noqa: E402
from helios_logprobs.launch.signals import Interrupted, StopSignals, env_rank, exit_process, say  # noqa: E402

log = logging.getLogger("launch")

DRAIN_S = 3.0
"""How long requests in flight may still finish after a stop (see serve_http)."""
GRACEFUL_S = 5
"""uvicorn's timeout_graceful_shutdown: it cancels what is still running after this long."""
PEER_REPORT_S = 10.0
"""How long a peer refused at start-up waits for rank 0 to report (see refused)."""
MIB = 1024 * 1024
API_SERVER_START_S = 180.0
"""How long the API server processes may take to listen."""


class ListenError(OSError):
    """The address to serve on cannot be bound (taken, or not this host's)."""


def startup_refusals() -> tuple[type[BaseException], ...]:
    """What start-up is refused with: one line, exit status 2 (a bad checkpoint or
    generation_config.json, shapes that do not shard over the ranks, a setting out of range,
    an address that cannot be bound). Imported here: --help needs no torch."""
    from helios_logprobs.ranks.model import (
        ModelConfigError,
        UnsupportedModelError,
        WeightLoadError,
    )
    from helios_logprobs.runtime.http.protocol.defaults import GenerationConfigError

    return (ModelConfigError, UnsupportedModelError, WeightLoadError, GenerationConfigError,
            ValueError, OSError)


def parse_args(argv: list[str] | None = None):
    return parse_serve_args(argv, description=__doc__)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before any weight loads (uvicorn listens on it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def refused(exc: BaseException, rank: int) -> int:
    """Report a start-up refusal: one ``helios: error:`` line from rank 0, exit status 2.

    A peer refused for the same reason as rank 0 (every rank loads the same shapes) stays
    silent: rank 0's exit makes torchrun end it within PEER_REPORT_S. A refusal of its own
    (rank 0 never learns of it) is reported by the peer after that wait."""
    log.debug("start-up refused", exc_info=exc)
    if rank == 0:
        say(f"error: {exc}")
        return 2
    try:
        time.sleep(PEER_REPORT_S)
    except Interrupted:
        return 2
    say(f"error: rank {rank}: {exc}")
    return 2


def ready_line(model: str, host: str, port: int, tp: int, max_logprobs: int,
               prompt_scoring: bool, dtype: str | None = None) -> str:
    """The start-up line (after ``helios: ``); ``dtype``: the serving dtype and why."""
    where = f"[{host}]" if ":" in host else host
    logprobs = f"K={max_logprobs}" if max_logprobs > 0 else "off"
    scoring = "on" if prompt_scoring else "off"
    weights = f", dtype: {dtype}" if dtype else ""
    return (f"serving {model} at http://{where}:{port}/v1 "
            f"(TP={tp}, logprobs: {logprobs}, prompt scoring: {scoring}{weights})")


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


def serve_http(args, argv: list[str], engine, model_dir, listener: socket.socket,
               stop: StopSignals, on_ready: Callable[[int], None]) -> bool:
    """The engine core's side of serving: start ``--api-server-count`` API server processes
    on ``listener`` (launch.api_server), joined to the engine over collectives.frontend, and
    wait for a stop; returns whether the engine was healthy then.

    A stop tells every API server to stop listening; requests in flight get DRAIN_S to
    finish, then the engine fails them (a stream ends with an error event), before the API
    servers' own GRACEFUL_S would cancel them mid-response. A forced stop fails them at once.
    An API server that dies has its requests aborted; the others keep serving (with none
    left the core stops)."""
    from prometheus_client.multiprocess import mark_process_dead

    from helios_logprobs.collectives.frontend import CoreSockets
    from helios_logprobs.runtime.frontend.core_endpoint import CoreEndpoint
    from helios_logprobs.runtime.http.metrics import frame_bytes_of

    count = args.api_server_count
    directory = tempfile.mkdtemp(prefix="helios-")
    metrics_dir = os.path.join(directory, "metrics")
    os.mkdir(metrics_dir)
    sockets = CoreSockets(directory, count)
    endpoint = CoreEndpoint(engine, sockets, count, frame_bytes_of(engine)).start()
    servers = [start_api_server(i, argv, listener, directory, model_dir, metrics_dir)
               for i in range(count)]
    stopping = threading.Event()
    healthy_at_stop: list[bool] = []

    def watch_servers() -> None:
        alive = set(range(count))
        while alive:
            for i in sorted(alive):
                status = servers[i].poll()
                if status is not None:
                    alive.discard(i)
                    mark_process_dead(servers[i].pid, metrics_dir)
                    endpoint.server_gone(i, f"exit status {status}", quiet=stopping.is_set())
            time.sleep(0.2)
        if not stopping.is_set():
            stop.request("every API server is gone")

    def exit_now() -> None:
        healthy_at_stop.append(engine.healthy())
        stopping.set()
        endpoint.shutdown(stop.reason or "stop")
        drain = threading.Timer(DRAIN_S, lambda: engine.fail("the server is shutting down"))
        drain.daemon = True
        drain.start()

    def force() -> None:
        engine.fail("the server is shutting down")
        for process in servers:
            with contextlib.suppress(OSError):
                process.terminate()

    threading.Thread(target=watch_servers, name="watch-api-servers", daemon=True).start()
    stop.on_stop(exit_now)
    stop.on_force(force)
    stop.serving()
    try:
        if endpoint.wait_ready(API_SERVER_START_S):
            on_ready(listener.getsockname()[1])
        elif not stopping.is_set():
            say("error: an API server did not start (its error is above)")
            healthy_at_stop.append(False)
            stop.request("an API server did not start")
        while not stopping.wait(0.5):
            pass
        deadline = time.monotonic() + DRAIN_S + GRACEFUL_S + 2
        for process in servers:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        endpoint.close()
        sockets.close()
        shutil.rmtree(directory, ignore_errors=True)
    return healthy_at_stop[0] if healthy_at_stop else engine.healthy()


SETTINGS_ENV, ARGV_ENV = "HELIOS_API_SERVER", "HELIOS_SERVE_ARGV"
"""What launch.api_server reads from its environment: its settings and the serve argv."""


def settings_env(index: int, fd: int, directory: str, core_pid: int, model_dir: str) -> str:
    return json.dumps({"index": index, "fd": fd, "directory": directory,
                       "core_pid": core_pid, "model_dir": model_dir})


def start_api_server(index: int, argv: list[str], listener: socket.socket, directory: str,
                     model_dir, metrics_dir: str) -> subprocess.Popen:
    """API server ``index`` (launch.api_server), holding ``listener``; not a rank (no RANK in
    its environment), in this process's group (a terminal's Ctrl-C reaches it too); its
    metrics go to ``metrics_dir``, shared by every API server."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")}
    env[SETTINGS_ENV] = settings_env(index, listener.fileno(), directory, os.getpid(),
                                     str(model_dir))
    env[ARGV_ENV] = json.dumps(argv)
    env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    env["OMP_NUM_THREADS"] = "1"  # (no torch work there: no thread pool beside the step's)
    return subprocess.Popen([sys.executable, "-m", "helios_logprobs.launch.api_server"],
                            env=env, pass_fds=(listener.fileno(),))


def queue_limit(args, engine) -> int | None:
    """The admission limit every API server applies (create_app's default)."""
    from helios_logprobs.runtime.http.metrics import default_queue_limit

    if args.max_queued_requests is not None:
        return args.max_queued_requests
    return default_queue_limit(engine.config.capacity)


def build_app(args, engine, model_dir):
    """The HTTP app for ``engine`` with the command line's frontend settings."""
    from helios_logprobs.runtime.http.access import Cors, protect
    from helios_logprobs.runtime.http.protocol.tools import ToolServing
    from helios_logprobs.runtime.http.server import create_app

    names = [engine.info.model_name, *(args.served_model_name or [])[1:]]
    app = create_app(engine, model_dir, names,
                     max_request_bytes=args.max_request_bytes,
                     max_queued_requests=args.max_queued_requests,
                     generation_config=args.generation_config,
                     log_requests=args.enable_log_requests)
    app.state.assets.tool_serving = ToolServing(args.tool_call_parser,
                                                args.enable_auto_tool_choice)
    cors = Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                tuple(args.allowed_headers), args.allow_credentials)
    protect(app, tuple(args.api_key or ()), cors)
    return app


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = env_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    stop = StopSignals(rank).install()
    tp = args.tensor_parallel_size
    if tp is not None and tp != world:
        return refused(ValueError(
            f"--tensor-parallel-size {tp} needs {tp} ranks, this job has {world}: start it "
            f"with helios-serve -tp {tp} (or torchrun --nproc-per-node {tp})"), rank)
    listener = cluster = engine = None
    try:
        try:
            if rank == 0:  # a taken port is refused before any weight loads
                listener = listen(args.host, args.port)
            from helios_logprobs.launch.cluster import join
            from helios_logprobs.runtime.http.protocol.defaults import load_sampling_defaults

            if args.model is not None:  # (a bad generation_config.json: before the weights)
                load_sampling_defaults(args.generation_config, args.model)
            cluster = join(args)
            if cluster.is_coordinator:
                engine = cluster.engine(stop)
        except Interrupted:
            return 0
        except Exception as exc:
            if isinstance(exc, startup_refusals()):
                return refused(exc, rank)
            raise
        if not cluster.is_coordinator:
            return cluster.run_peer(stop)
        info, world = engine.info, cluster.world
        try:
            sizing = capacity_line(engine, world, queue_limit(args, engine))
        except Exception as exc:  # noqa: BLE001 - a report, never a reason not to serve
            sizing = f"capacity summary unavailable ({type(exc).__name__}: {exc})"

        from helios_logprobs.kernels.native import absence

        native_line = absence()  # (one line where the native CPU kernels are off or absent)

        from helios_logprobs.ranks.model.dtype import resolve_dtype

        config = cluster.config
        dtype = "{} ({})".format(*resolve_dtype(config.dtype, config.device, config.model_dir))

        def on_ready(port: int) -> None:
            if not stop.requested:
                say(ready_line(info.model_name, args.host, port, world, info.max_logprobs,
                               info.prompt_logprobs, dtype))
                say(sizing)
                if native_line is not None:
                    say(native_line)

        settle_heap()  # the app's objects too
        healthy = serve_http(args, list(sys.argv[1:] if argv is None else argv), engine,
                             config.model_dir, listener, stop, on_ready)
        return 0 if healthy else 1
    except Interrupted:
        return 0
    finally:
        if cluster is not None and cluster.is_coordinator:
            cluster.close(engine)
        if listener is not None:
            listener.close()


if __name__ == "__main__":
    exit_process(main())
