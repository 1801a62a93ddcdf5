"""Joining the torchrun job: process group, this rank's shard, the control channel; stop
signals, load progress and the few lines rank 0 prints (``say``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from collectives.control import ControlConfig, default_store, open_control
from collectives.groups import barrier, destroy, init_from_env, world_group
from ranks.step import RankStep
from ranks.worker import run_peer
from runtime.engine.bootstrap import build_engine, load_rank
from runtime.engine.config import RuntimeConfig
from runtime.engine.engine import Engine
from runtime.text.reasoning import PARSERS

log = logging.getLogger("launch")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Serving options; every default is RuntimeConfig's (runtime/engine/config.py)."""
    d = RuntimeConfig.default
    p.add_argument("--model", type=Path, default=None,
                   help="local Hugging Face directory; default: the embedded tiny model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--capacity", type=int, default=d("capacity"), help="physical request slots")
    p.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                   help="default: the checkpoint's max_position_embeddings, at most 4096")
    p.add_argument("--chunk-size", type=int, default=d("chunk_size"),
                   help="prefill chunk in tokens")
    p.add_argument("--max-batched-tokens", type=int, default=d("max_batched_tokens"),
                   help="tokens per step; default: twice the larger of chunk size and capacity")
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="allocate prompt scoring (prompt_logprobs, echo with logprobs); "
                        "costs fixed memory, off by default")
    p.add_argument("--no-logprobs", action="store_true",
                   help="export a core without logprob buffers (K=0)")
    p.add_argument("--max-logprobs", type=int, default=d("max_logprobs"),
                   help="K natural alternatives the core exports (1..20); below 20 the core "
                        "declares no token-ID inputs and refuses logprob_token_ids")
    p.add_argument("--completion-token-capacity", type=int,
                   default=d("completion_token_capacity"),
                   help="T token slots per completion record; 0 means 8")
    p.add_argument("--reduction-backend", choices=("torch", "triton"), default=None,
                   help="default: triton on CUDA, torch on CPU")
    p.add_argument("--speculative-tokens", type=int, default=d("speculative_tokens"),
                   help="N history proposals (prompt lookup) verified per decode; 0: off. "
                        "Needs N + 1 <= T (--completion-token-capacity)")
    p.add_argument("--ngram-min", type=int, default=d("ngram_min"),
                   help="shortest suffix n-gram matched for a proposal")
    p.add_argument("--ngram-max", type=int, default=d("ngram_max"),
                   help="longest suffix n-gram matched for a proposal")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every row's logprobs independent of its batch (identical with "
                        "speculation on and off); slower")
    p.add_argument("--reasoning-parser", choices=sorted(PARSERS),
                   default=d("reasoning_parser"),
                   help="thinking spans <think>...</think>; enables thinking_token_budget")
    p.add_argument("--reasoning-config", type=_json_object, default=d("reasoning_config"),
                   help='JSON {"reasoning_start_str": ..., "reasoning_end_str": ...}: the '
                        "thinking delimiters (override the parser's)")
    p.add_argument("--collective-timeout", type=float, default=d("collective_timeout_s"),
                   help="seconds before a silent peer fails a collective")
    p.add_argument("--heartbeat-timeout", type=float, default=d("heartbeat_timeout_s"),
                   help="seconds without a heartbeat before a rank counts as lost")
    p.add_argument("--log-level", default="WARNING")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def runtime_config(args: argparse.Namespace, device: str) -> RuntimeConfig:
    model_dir = args.model
    if model_dir is None:
        from launch.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model()
    backend = args.reduction_backend or ("triton" if device == "cuda" else "torch")
    return RuntimeConfig(
        model_dir=Path(model_dir),
        served_model_name=args.served_model_name,
        device=device,
        capacity=args.capacity,
        max_model_len=args.max_model_len,
        chunk_size=args.chunk_size,
        max_batched_tokens=args.max_batched_tokens,
        logprobs=not args.no_logprobs,
        prompt_logprobs=args.prompt_logprobs,
        max_logprobs=args.max_logprobs,
        completion_token_capacity=args.completion_token_capacity,
        reduction_backend=backend,
        collective_timeout_s=args.collective_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        speculative_tokens=args.speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        batch_invariant=args.batch_invariant,
        reasoning_parser=args.reasoning_parser,
        reasoning_config=args.reasoning_config,
    )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ECHO_S = 2.0
"""Under torchrun a terminal's Ctrl-C reaches every rank twice: from the terminal and
forwarded by torchrun. A repeat within this many seconds of the first signal is that echo."""
START_GRACE_S = 5.0
"""A rank stopped while starting up exits (status ``StopSignals.status``) this long after the
signal even if its main thread is still blocked, e.g. in a store or collective wait for a rank
that has already left."""
STOP_GRACE_S = 15.0
"""A rank stopped while serving that is still running this long after the signal (a peer that
never got the coordinator's Shutdown, say) logs an error and exits with status 1."""


def say(text: str) -> None:
    """One ``helios: <text>`` line on stderr, in one write(2) call: safe in a signal handler,
    never interleaved with another line. On a terminal it first erases a progress line."""
    erase = "\r\033[K" if os.isatty(2) else ""
    try:
        os.write(2, f"{erase}helios: {text}\n".encode())
    except OSError:
        pass


def env_rank() -> int:
    """This process's rank as torchrun exports it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class Interrupted(BaseException):
    """A stop signal arrived while this rank was still starting up (see StopSignals)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP end this rank without a traceback; rank 0 announces the
    stop in one line, ``helios: shutting down (<reason>)``, and every other rank stays silent.

    Until ``serving()`` a signal raises Interrupted in the main thread, so a long load or
    start-up ends at once. From ``serving()`` on it only requests a stop: the ``on_stop``
    callbacks run (the coordinator's stops uvicorn, a peer's asks the coordinator to stop the
    job) and the process leaves through its normal cleanup. A repeat within ECHO_S of the
    first signal is ignored; a later one runs the ``on_force`` callbacks.

    Python runs signal handlers in the main thread only, and only between bytecodes: a main
    thread blocked in C++ (a store wait, a collective) would never see them. So the signals
    also go to a thread (``signal.set_wakeup_fd``) that requests the stop at once, and a
    deadline ends the process if its cleanup does not: START_GRACE_S after a signal during
    start-up (quietly, with ``status``), STOP_GRACE_S after one while serving (status 1).
    Handlers are installed even where SIGINT was ignored at start (a background job), as
    torchrun forwards SIGINT to its workers.
    """

    def __init__(self, rank: int, status: int = 0) -> None:
        self.rank = rank
        self.status = status
        self.reason: str | None = None
        self.signum: int | None = None
        self._raise = True
        self._raised = False
        self._at = 0.0
        self._lock = threading.RLock()  # re-entrant: the handler may interrupt its own thread
        self._on_stop: list[Callable[[], None]] = []
        self._on_force: list[Callable[[], None]] = []

    def install(self) -> StopSignals:
        """Install the handlers and the signal thread (from the main thread)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals",
                         daemon=True).start()
        return self

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def serving(self) -> None:
        """From now on a signal requests a stop instead of raising Interrupted."""
        self._raise = False

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a stop is requested (now, if it already was)."""
        with self._lock:
            self._on_stop.append(fn)
            now = self.requested
        if now:
            _call(fn)

    def on_force(self, fn: Callable[[], None]) -> None:
        self._on_force.append(fn)

    def request(self, reason: str, signum: int | None = None) -> bool:
        """Ask for a stop, from any thread; the first request wins and is the one announced.
        Returns whether this was the first."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason, self.signum, self._at = reason, signum, time.monotonic()
            callbacks = list(self._on_stop)
            starting = self._raise
        if self.rank == 0:
            say(f"shutting down ({reason})")
        grace = START_GRACE_S if starting else STOP_GRACE_S
        deadline = threading.Timer(grace, self._deadline, args=(grace, starting))
        deadline.daemon = True
        deadline.start()
        for fn in callbacks:
            _call(fn)
        return True

    def _handle(self, signum: int, frame: object) -> None:
        # The main thread, once it runs Python again; the signal thread has usually already
        # requested the stop (and counted any repeat).
        self.request(signal.Signals(signum).name, signum)
        if self._raise and not self._raised:
            self._raised = True
            raise Interrupted(signum)

    def _watch(self, fd: int) -> None:
        while True:
            for signum in os.read(fd, 64):  # one byte per signal that has a Python handler
                if signum not in STOP_SIGNALS:
                    continue
                first = self.request(signal.Signals(signum).name, signum)
                if not first and time.monotonic() - self._at > ECHO_S:
                    for fn in list(self._on_force):
                        _call(fn)

    def _deadline(self, grace: float, starting: bool) -> None:
        if starting:
            exit_process(self.status)
        log.error("rank %d: still running %.0f s after %s; exiting", self.rank, grace,
                  self.reason)
        exit_process(1)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a stop callback must not turn into a traceback
        log.warning("stop callback %r failed", fn, exc_info=True)


def process_key(rank: int) -> str:
    """Where each rank publishes ``host:pid``, so the coordinator can end a hung peer."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "default")
    return f"helios/{job}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/process-{rank}"


def end_hung_peers(ranks: tuple[int, ...]) -> None:
    """SIGKILL the hung peers that run on this host: a stopped process cannot act on
    torchrun's SIGTERM, and torchrun would wait ~30 s before its own SIGKILL. Killed here,
    the whole job is gone within a few seconds of the coordinator's exit."""
    store, host = default_store(), socket.gethostname()
    for rank in ranks:
        try:
            where, _, pid = store.get(process_key(rank)).decode().rpartition(":")
            if where == host:
                os.kill(int(pid), signal.SIGKILL)
                log.error("rank %d (pid %s) is hung: killed it so the job ends now", rank, pid)
        except Exception as exc:  # noqa: BLE001 - best effort: torchrun still ends it later
            log.error("could not end hung rank %d: %s", rank, exc)


def stop_key() -> str:
    """Where a signalled peer asks the coordinator to stop the job (torch.distributed store);
    per torchrun restart, so a restarted job does not see its predecessor's request."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "default")
    return f"helios/{job}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/stop"


class ProgressLine:
    """Rank 0's weight-loading progress on stderr, as a ``progress(done, total)`` callback.

    On a terminal: one line redrawn in place (at most every REDRAW_S), erased when the load
    ends. Otherwise (logs, tests): nothing for a load that ends within FIRST_S, then a line
    every EVERY_S and one when it is done.
    """

    REDRAW_S = 0.1
    FIRST_S = 5.0
    EVERY_S = 10.0

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty() if tty is None else tty
        self.start = time.monotonic()
        self._last: float | None = None
        self._drawn = False
        self._logged = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        if self.tty:
            if done < total and (self._last is None or now - self._last >= self.REDRAW_S):
                self._write(f"\r\033[Khelios: {self._text(done, total, elapsed)}")
                self._drawn = True
                self._last = now
        elif elapsed >= self.FIRST_S and (self._last is None or now - self._last >= self.EVERY_S):
            self._write(f"helios: {self._text(done, total, elapsed)}\n")
            self._logged = True
            self._last = now

    def close(self) -> None:
        if self._drawn:
            self._write("\r\033[K")
        elif self._logged:
            self._write(f"helios: loaded weights in {time.monotonic() - self.start:.0f} s\n")
        self._drawn = self._logged = False

    @staticmethod
    def _text(done: int, total: int, elapsed: float) -> str:
        return f"loading weights {100 * done // max(total, 1)}% ({elapsed:.0f} s)"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


@dataclass
class Cluster:
    rank: int
    world: int
    group: object
    config: RuntimeConfig
    step: RankStep
    channel: object | None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def run_peer(self, stop: StopSignals | None = None) -> int:
        """The peer loop until the coordinator's Shutdown; returns the exit status.

        With ``stop`` a signal does not end the loop: it asks the coordinator to stop the job
        and the loop ends on the coordinator's Shutdown, as every other stop does (or at
        StopSignals' deadline). A failure after the signal (the coordinator gone mid-step)
        ends the loop quietly with status 0.
        """
        if stop is not None:
            stop.on_stop(lambda: self._ask_to_stop(stop))
            stop.serving()
        try:
            return run_peer(self.step, self.channel)
        except Exception:
            if stop is None or not stop.requested:
                raise
            log.info("rank %d: loop ended during the shutdown", self.rank, exc_info=True)
            return 0
        finally:
            self.channel.close()
            destroy()

    def _ask_to_stop(self, stop: StopSignals) -> None:
        reason = f"{stop.reason} on rank {self.rank}"

        def publish() -> None:
            try:
                default_store().set(stop_key(), reason)
            except Exception:  # noqa: BLE001 - the job is going away anyway
                log.info("rank %d: could not publish the stop", self.rank, exc_info=True)

        threading.Thread(target=publish, name="stop-publish", daemon=True).start()

    def engine(self, stop: StopSignals | None = None) -> Engine:
        """The coordinator's engine, started; with peers, a thread watches them (and, with
        ``stop``, passes a stop a peer asked for on to it)."""
        broadcast = self.channel.broadcast if self.channel is not None else None
        engine = build_engine(self.config, self.step, broadcast).start()
        if self.channel is not None:
            threading.Thread(target=watch_peers, args=(self.channel, engine, stop),
                             name="watch-peers", daemon=True).start()
        return engine

    def close(self, engine: Engine | None) -> None:
        if engine is not None:
            engine.shutdown()
        if self.channel is not None:
            self.channel.shutdown("coordinator exiting")
        destroy()


def join(args: argparse.Namespace) -> Cluster:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not cuda:
        # Ranks on one host share its cores; oversubscribed BLAS threads are many times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    topology = init_from_env(timeout_s=args.collective_timeout) if world > 1 else None
    group = world_group() if world > 1 else None
    rank = topology.rank if topology else 0
    if args.model is None:
        # Rank 0 builds the embedded model first; the others then find it cached (or, on
        # another node, build the identical deterministic checkpoint themselves).
        if rank == 0:
            runtime_config(args, "cpu")
        barrier(group)
    config = runtime_config(args, "cuda" if cuda else "cpu")
    progress = ProgressLine() if rank == 0 else None
    try:
        step = load_rank(config, group, progress)
    finally:
        if progress is not None:
            progress.close()
    control = ControlConfig(heartbeat_timeout_s=config.heartbeat_timeout_s)
    channel = open_control(rank, world, config=control) if world > 1 else None
    if world > 1:
        default_store().set(process_key(rank), f"{socket.gethostname()}:{os.getpid()}")
    return Cluster(rank, world, group, config, step, channel)


def watch_peers(channel, engine: Engine, stop: StopSignals | None = None,
                grace_s: float = 2.0) -> None:
    """Fail every request and end the job when a peer stops answering; hand a stop that a
    signalled peer asked for (``stop_key`` in the store) to ``stop``."""
    store = default_store() if stop is not None else None
    key = stop_key()
    while engine.healthy():
        dead = channel.dead_peers()
        if dead:
            engine.fail(f"peer rank(s) {list(dead)} stopped answering")
            log.error("peer rank(s) %s stopped answering; requests failed, exiting", list(dead))
            time.sleep(grace_s)
            end_hung_peers(dead)
            os._exit(1)
        if store is not None and not stop.requested:
            try:
                if store.check([key]):
                    stop.request(store.get(key).decode())
            except Exception:  # noqa: BLE001 - the store's host (torchrun) is going away
                store = None
        time.sleep(0.5)


def exit_process(code: int) -> None:
    """End the process with ``code`` once our own cleanup is done.

    Interpreter finalization would then destroy the C++ side of the process group and the
    rank-0 TCPStore daemon in an unspecified order, which under load can abort the process
    ("terminate called without an active exception") after a clean shutdown. Everything
    this process owns is already flushed and closed, so it leaves without finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
