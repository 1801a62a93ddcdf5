"""Control-plane plumbing shared by both ends: the control plane's own messages, failures,
configuration, endpoint discovery through the torch.distributed store, and the channel base
(sockets, heartbeat thread, close).
``collectives.control`` is the public face; import from there."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import zmq

from helios_logprobs.collectives.codec import message

log = logging.getLogger(__name__)


def _check(ok: bool, what: str, value: object) -> None:
    if not ok:
        raise ValueError(f"control message: bad {what} {value!r}")


@message("control.peer_ready")
@dataclass(frozen=True)
class PeerReady:
    rank: int

    def __post_init__(self) -> None:
        _check(type(self.rank) is int and self.rank > 0, "peer rank", self.rank)


@message("control.peer_error")
@dataclass(frozen=True)
class PeerError:
    rank: int
    message: str

    def __post_init__(self) -> None:
        _check(type(self.rank) is int and self.rank > 0, "peer rank", self.rank)
        _check(isinstance(self.message, str), "error message", self.message)


@message("control.step_done")
@dataclass(frozen=True)
class StepDone:
    rank: int
    submission: int

    def __post_init__(self) -> None:
        _check(type(self.rank) is int and self.rank > 0, "peer rank", self.rank)
        _check(type(self.submission) is int and self.submission >= 0, "submission",
               self.submission)


@message("control.heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    rank: int
    t: float
    """Sender's wall clock (time.time()), informational; liveness uses the receiver's clock."""

    def __post_init__(self) -> None:
        _check(type(self.rank) is int and self.rank >= 0, "rank", self.rank)
        _check(type(self.t) is float, "time", self.t)


@message("control.shutdown")
@dataclass(frozen=True)
class Shutdown:
    reason: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.reason, str), "shutdown reason", self.reason)


class ControlError(RuntimeError):
    """Base class of control-plane failures."""


class ControlTimeout(ControlError, TimeoutError):
    """A bounded wait (store look-up, handshake, receive, blocked send) ran out."""


class PeerLost(ControlError):
    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = tuple(sorted(ranks))
        super().__init__(f"control plane: lost peer rank(s) {list(self.ranks)}")


class PeerFailed(ControlError):
    """A peer reported ``PeerError`` while the coordinator waited for it."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank, self.message = rank, message
        super().__init__(f"control plane: rank {rank} failed: {message}")


class CoordinatorLost(ControlError):
    """The coordinator has been silent for longer than the heartbeat timeout."""


@dataclass(frozen=True)
class ControlConfig:
    job_id: str = field(default_factory=lambda: os.environ.get("TORCHELASTIC_RUN_ID", "default"))
    host: str | None = None
    """Address the coordinator binds and publishes; None: ``default_host()``."""
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    connect_timeout_s: float = 60.0
    """Store look-up of the endpoints and the ready handshake."""
    send_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id:
            raise ValueError(f"ControlConfig: bad job_id {self.job_id!r}")
        if not 0.0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("ControlConfig: need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if not (self.connect_timeout_s > 0.0 and self.send_timeout_s > 0.0):
            raise ValueError("ControlConfig: timeouts must be positive")

    def key(self, name: str) -> str:
        return f"helios/{self.job_id}/control/{name}"


def default_host() -> str:
    """MASTER_ADDR when it is an address of this host, else this host's address towards it
    (or towards the default route), else 127.0.0.1."""
    master = os.environ.get("MASTER_ADDR")
    target = "10.255.255.255"
    if master:
        try:
            target = socket.gethostbyname(master)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((target, 0))
            return target
        except OSError:
            pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # UDP: picks the outgoing interface, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def default_store() -> dist.Store:
    """The store of the initialised default process group."""
    if not dist.is_initialized():
        raise ControlError("control plane: no store given and no process group initialised")
    return dist.distributed_c10d._get_default_store()


def store_get(store: dist.Store, key: str, timeout_s: float) -> str:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return store.get(key).decode()
    except RuntimeError as exc:
        raise ControlTimeout(f"control plane: {key!r} not in the store after {timeout_s} s "
                             f"({exc})") from exc


def identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class Channel:
    """Shared by both ends: config, zmq context, socket factory, heartbeat thread, close."""

    def __init__(self, config: ControlConfig | None) -> None:
        self.config = config if config is not None else ControlConfig()
        self.closed = False
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None

    def _socket(self, kind: int, ipv6: bool) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout_s * 1000))
        sock.setsockopt(zmq.IPV6, int(ipv6))
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its id over
        return sock

    def _liveness_socket(self, kind: int, ipv6: bool) -> zmq.Socket:
        """A socket whose connection libzmq itself keeps alive: ZMTP PING every interval from
        libzmq's I/O thread (no Python thread, so a process busy in Python for minutes still
        answers), and the connection is closed after ``heartbeat_timeout_s`` without traffic
        (a SIGSTOPped or dead peer)."""
        sock = self._socket(kind, ipv6)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.config.heartbeat_interval_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.config.heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.config.heartbeat_timeout_s * 1000))
        return sock

    def _start_watch(self, sockets: dict[zmq.Socket, Callable[[list[bytes]], None]]) -> None:
        """Run the liveness thread; it owns ``sockets`` from here on (handed over at start)
        and passes each arrival to its handler. Only the handlers' bookkeeping runs in Python:
        the keep-alive itself is libzmq's, so this thread being starved delays what this
        side notices, never what the other side sees."""

        def run() -> None:
            poller = zmq.Poller()
            for sock in sockets:
                poller.register(sock, zmq.POLLIN)
            try:
                while not self._stop.is_set():
                    for sock, _ in poller.poll(100):
                        sockets[sock](sock.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError as exc:
                if not self._stop.is_set():
                    log.error("control plane: liveness thread stopped: %s", exc)
            except Exception:
                log.exception("control plane: liveness thread failed")
            finally:
                for sock in sockets:
                    sock.close(linger=0)

        self._thread = threading.Thread(target=run, name=f"{type(self).__name__}-hb", daemon=True)
        self._thread.start()

    def poll(self, timeout: float = 0.0) -> Any | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def recv(self, timeout: float) -> Any:
        """``poll`` that raises ControlTimeout instead of returning None."""
        got = self.poll(timeout)
        if got is None:
            raise ControlTimeout(f"control plane: nothing received within {timeout} s")
        return got

    def close(self, linger_s: float = 0.0) -> None:
        """Stop the heartbeat thread and close every socket (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._sock is not None:
            self._sock.close(linger=int(linger_s * 1000))
        self._ctx.destroy(linger=0)  # closes any socket a failed constructor left behind

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
