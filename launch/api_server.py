"""One API server process: `python -m helios_logprobs.launch.api_server` (started by
launch.serve's engine core, never by hand). It serves HTTP on the core's listening socket
(inherited, shared with the other API servers) and reaches the engine over
collectives.frontend. The core tells it to stop (Shutdown) or it ends itself when the core
is gone: every request in flight then ends with an error, and the process exits 1.

Its settings come from the environment: HELIOS_API_SERVER (index, socket fd, the core's
directory and pid, the model folder) and HELIOS_SERVE_ARGV (the serve command line, JSON).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from helios_logprobs.collectives.frontend import ServerSockets
from helios_logprobs.launch.serve import ARGV_ENV, GRACEFUL_S, SETTINGS_ENV, HttpServer, build_app
from helios_logprobs.launch.serve_options import parse_serve_args
from helios_logprobs.launch.signals import exit_process
from helios_logprobs.runtime.frontend.remote_engine import RemoteEngine

log = logging.getLogger("launch")
WATCH_S = 0.25
"""How often the process looks for its engine core."""
CORE_GONE_GRACE_S = 1.0
"""After the core is gone, uvicorn's graceful stop ends the connections in flight (their
error events sent); this much later the process exits regardless."""


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the core handles it
    settings = json.loads(os.environ[SETTINGS_ENV])
    args = parse_serve_args(json.loads(os.environ[ARGV_ENV]))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    index, core_pid = settings["index"], settings["core_pid"]
    engine = RemoteEngine(ServerSockets(settings["directory"], index), index)
    app = build_app(args, engine, settings["model_dir"])
    listener = socket.socket(fileno=settings["fd"])
    config = uvicorn.Config(app, log_level="warning",
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=GRACEFUL_S, lifespan="off",
                            loop="asyncio")
    if not args.disable_uvicorn_access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = HttpServer(config, engine.ready)
    core_gone = threading.Event()

    def stop(*_: object) -> None:
        server.should_exit = True

    def watch_core() -> None:
        while os.getppid() == core_pid:
            time.sleep(WATCH_S)
        core_gone.set()
        engine.fail("the engine core is gone")
        server.should_exit = True  # no new connections; streams in flight end with the error
        time.sleep(GRACEFUL_S + CORE_GONE_GRACE_S)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    engine.on_shutdown = lambda reason: stop()
    threading.Thread(target=watch_core, name="watch-core", daemon=True).start()
    server.run(sockets=[listener])
    engine.close()
    return 1 if core_gone.is_set() else 0


if __name__ == "__main__":
    exit_process(main())
