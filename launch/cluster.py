"""Joining the torchrun job: process group, this rank's shard, the control channel, load
progress; the coordinator's watch over its peers."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

import torch

from helios_logprobs.collectives.control import ControlConfig, default_store, open_control
from helios_logprobs.collectives.groups import barrier, destroy, init_from_env, world_group
from helios_logprobs.launch.arguments import runtime_config
from helios_logprobs.launch.heap import settle_heap
from helios_logprobs.launch.signals import StopSignals
from helios_logprobs.ranks.step import RankStep
from helios_logprobs.ranks.worker import run_peer
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.engine.engine import Engine

log = logging.getLogger("launch")


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
        fraction = getattr(args, "gpu_memory_utilization", None)
        if fraction is not None:  # vLLM's --gpu-memory-utilization, as an allocator limit
            torch.cuda.set_per_process_memory_fraction(fraction)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not cuda:
        # Ranks on one host share its cores; oversubscribed BLAS threads are many times slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    topology = init_from_env(timeout_s=args.collective_timeout) if world > 1 else None
    group = world_group() if world > 1 else None
    rank = topology.rank if topology else 0
    if args.model in (None, "tiny"):
        # Rank 0 builds the embedded model (or prepares the default GGUF) first; the others
        # then find it cached (or, on another node, build the identical checkpoint themselves).
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
    settle_heap()
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
