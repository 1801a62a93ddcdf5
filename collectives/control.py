"""Control plane: the coordinator (rank 0) talks to its peers over ZeroMQ.

Sockets. The coordinator binds a ROUTER socket on a random port of one host (default:
``default_host()``) and publishes ``tcp://host:port`` in the torch.distributed store under
``helios/<job_id>/control/endpoint``. Each peer connects a DEALER (routing id ``rank-<r>``)
to it: this pair carries messages in both directions, in order. Each peer also binds a
liveness socket and publishes it as ``.../heartbeat-<r>``; once every peer is ready the
coordinator connects one liveness socket to each (one connection per peer, so a closed
connection names its rank). Liveness sockets belong to one background thread on each side
(ZMQ sockets are never shared between threads). Every peer sends ``PeerReady`` first and the
coordinator's ``wait_ready`` collects all of them, so nothing sent afterwards can be dropped:
a ROUTER with ``ROUTER_MANDATORY`` raises (``PeerLost``) instead of dropping a message to a peer
that is not connected, and a send that blocks longer than ``send_timeout_s`` raises
``ControlTimeout``.

Liveness is libzmq's own ZMTP heartbeating on the liveness connections: each side's I/O
thread pings every ``heartbeat_interval_s`` and answers pings without the Python interpreter,
so a rank busy in Python (a long tokenization holding the interpreter lock) stays alive to
the others. A connection silent for ``heartbeat_timeout_s`` (a SIGSTOPped process) is closed
by libzmq, and a dead process's by its kernel; socket monitors report the disconnect: the
coordinator's ``dead_peers()`` then names the rank (and ``poll`` raises ``PeerLost``), a
peer's ``poll`` raises ``CoordinatorLost``. A malformed payload raises ``CodecError`` from
``poll`` after it was consumed: the channel stays usable.

A channel's sockets belong to the thread that uses it (besides its own heartbeat thread);
``dead_peers``, ``last_seen``, ``silence`` and ``coordinator_alive`` may be called from any
thread.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import zmq

from helios_logprobs.collectives.codec import CodecError, decode, encode
from helios_logprobs.collectives.control_base import (
    Channel,
    ControlConfig,
    ControlError,
    ControlTimeout,
    CoordinatorLost,
    Heartbeat,
    PeerError,
    PeerFailed,
    PeerLost,
    PeerReady,
    Shutdown,
    StepDone,
    default_host,
    default_store,
    identity,
    store_get,
)


class CoordinatorChannel(Channel):
    """Rank 0's end: binds, publishes its endpoints, then ``wait_ready`` for every peer."""

    def __init__(self, store: dist.Store, world_size: int,
                 config: ControlConfig | None = None) -> None:
        super().__init__(config)
        if world_size < 1:
            raise ValueError(f"CoordinatorChannel: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.peers = tuple(range(1, world_size))
        self._last_seen: dict[int, float] = {}
        self._ready: set[int] = set()
        self.dropped = 0
        """Frames from routing ids that are not one of this world's peers (ignored)."""
        self._pending: deque[tuple[int, Any]] = deque()
        host = self.config.host or default_host()
        if ":" not in host:  # a name: bind and publish its IPv4 address
            host = socket.gethostbyname(host)
        base = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        self._sock = self._socket(zmq.ROUTER, ":" in host)
        try:
            self.endpoint = f"{base}:{self._sock.bind_to_random_port(base)}"
            store.set(self.config.key("endpoint"), self.endpoint)
        except BaseException:
            self.close()
            raise
        self._store = store
        self._lost: dict[int, float] = {}

    def _touch(self, ident: bytes) -> int | None:
        rank = int(ident[5:]) if ident[:5] == b"rank-" and ident[5:].isdigit() else None
        with self._lock:
            if rank is None or rank not in self.peers:
                self.dropped += 1
                return None
            self._last_seen[rank] = time.monotonic()
        return rank

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait for ``PeerReady`` from every peer; ControlTimeout names the missing ranks."""
        missing = [r for r in self.peers if r not in self._ready]
        self.gather(PeerReady, self.config.connect_timeout_s if timeout is None else timeout,
                    ranks=missing)
        if self._thread is None and self.peers:
            self._watch_peers()

    def _watch_peers(self) -> None:
        """One liveness connection to each ready peer; a disconnect marks that rank lost."""
        watched = {}
        for rank in self.peers:
            endpoint = store_get(self._store, self.config.key(f"heartbeat-{rank}"),
                                 self.config.connect_timeout_s)
            sock = self._liveness_socket(zmq.DEALER, "[" in endpoint)
            sock.connect(endpoint)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            watched[sock] = _ignore
            watched[monitor] = self._marker(rank)
        self._start_watch(watched)

    def _marker(self, rank: int):
        def lost(frames: list[bytes]) -> None:
            with self._lock:
                self._lost.setdefault(rank, time.monotonic())

        return lost

    def send(self, rank: int, msg: Any) -> None:
        self._send(rank, encode(msg))

    def broadcast(self, msg: Any) -> None:
        """Send one message to every peer (encoded once); per-peer order is preserved."""
        self.broadcast_bytes(encode(msg))

    def broadcast_bytes(self, payload: bytes) -> None:
        for rank in self.peers:
            self._send(rank, payload)

    def _send(self, rank: int, payload: bytes) -> None:
        try:
            self._sock.send_multipart([identity(rank), payload], copy=len(payload) < 65536)
        except zmq.Again as exc:
            raise ControlTimeout(f"control plane: send to rank {rank} blocked for "
                                 f"{self.config.send_timeout_s} s") from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerLost((rank,)) from exc
            raise

    def _next(self, timeout: float, check: Iterable[int] = ()) -> tuple[int, Any] | None:
        deadline, wait = time.monotonic() + max(timeout, 0.0), 0.0
        while True:
            dead = [r for r in self.dead_peers() if r in check]
            if dead:
                raise PeerLost(dead)
            if self._sock.poll(wait * 1000):
                got = self._read(self._sock.recv_multipart(zmq.NOBLOCK))
                if got is not None:
                    return got
                wait = 0.0
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait = min(left, self.config.heartbeat_interval_s)

    def _read(self, frames: list[bytes]) -> tuple[int, Any] | None:
        rank = self._touch(frames[0])
        if rank is None:
            return None
        if len(frames) != 2:
            raise CodecError(f"from rank {rank}: expected 1 payload frame, got {len(frames) - 1}")
        try:
            msg = decode(frames[1])
        except CodecError as exc:
            raise CodecError(f"from rank {rank}: {exc}") from exc
        if isinstance(msg, PeerReady):
            self._ready.add(rank)
        return None if isinstance(msg, Heartbeat) else (rank, msg)

    def poll(self, timeout: float = 0.0, check: bool = True) -> tuple[int, Any] | None:
        """Next ``(rank, message)`` from a peer, or None after ``timeout`` seconds.

        Raises PeerLost (with ``check``) while a peer is silent past the heartbeat timeout
        (messages already taken off the socket by ``gather`` come first), CodecError for a
        malformed payload (consumed: poll again)."""
        if self._pending:
            return self._pending.popleft()
        return self._next(timeout, self.peers if check else ())

    def gather(self, kind: type, timeout: float,
               ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """The next message of type ``kind`` from each of ``ranks`` (default: every peer).

        Other messages stay queued for ``poll`` in arrival order; a ``PeerError`` raises
        PeerFailed, silence of one of ``ranks`` PeerLost, the deadline ControlTimeout."""
        want, got = set(self.peers if ranks is None else ranks), {}
        if not want <= set(self.peers):
            raise ValueError(f"gather: {sorted(want)} are not all peers of {self.peers}")
        arrivals, seen = deque(self._pending), []
        self._pending.clear()
        deadline = time.monotonic() + timeout
        try:
            while len(got) < len(want):
                item = arrivals.popleft() if arrivals else self._next(
                    deadline - time.monotonic(), check=want)
                if item is None:
                    raise ControlTimeout(f"control plane: no {kind.__name__} from rank(s) "
                                         f"{sorted(want - got.keys())} within {timeout} s")
                rank, msg = item
                if isinstance(msg, PeerError):
                    raise PeerFailed(rank, msg.message)
                seen.append(item)
                if isinstance(msg, kind) and rank in want and rank not in got:
                    got[rank] = msg
        except BaseException:  # nothing is taken: later calls see every message, in order
            self._pending.extend(seen)
            self._pending.extend(arrivals)
            raise
        self._pending.extend(item for item in seen if got.get(item[0]) is not item[1])
        self._pending.extend(arrivals)
        return got

    def last_seen(self) -> dict[int, float]:
        """Seconds since each peer was last heard from (peers heard at least once)."""
        now = time.monotonic()
        with self._lock:
            return {rank: now - t for rank, t in sorted(self._last_seen.items())}

    def dead_peers(self) -> tuple[int, ...]:
        """Peers whose liveness connection libzmq closed (dead, or silent past the timeout)."""
        with self._lock:
            return tuple(sorted(self._lost))

    def check_peers(self) -> None:
        dead = self.dead_peers()
        if dead:
            raise PeerLost(dead)

    def shutdown(self, reason: str = "", linger_s: float = 1.0) -> None:
        """Best-effort ``Shutdown`` to every reachable peer, then close (flushing up to
        ``linger_s``)."""
        if not self.closed:
            payload = encode(Shutdown(reason))
            for rank in self.peers:
                try:
                    self._sock.send_multipart([identity(rank), payload], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self.close(linger_s)


class PeerChannel(Channel):
    """A rank > 0: finds the coordinator in the store, connects and announces ``PeerReady``."""

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 config: ControlConfig | None = None) -> None:
        super().__init__(config)
        if not 0 < rank < world_size:
            raise ValueError(f"PeerChannel: rank {rank} is not a peer in a world of {world_size}")
        self.rank = rank
        try:
            timeout = self.config.connect_timeout_s
            self.endpoint = store_get(store, self.config.key("endpoint"), timeout)
            self._sock = self._socket(zmq.DEALER, "[" in self.endpoint)
            self._sock.setsockopt(zmq.ROUTING_ID, identity(rank))
            self._sock.connect(self.endpoint)
            host = socket.gethostbyname(default_host())
            base = f"tcp://{host}"
            hb = self._liveness_socket(zmq.DEALER, False)
            self.heartbeat_endpoint = f"{base}:{hb.bind_to_random_port(base)}"
            watched = {hb: _ignore}
            for sock in (hb, self._sock):  # the coordinator's liveness connection, and a
                # dead coordinator's reset main connection (before it connected liveness)
                watched[sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)] = self._on_lost
            store.set(self.config.key(f"heartbeat-{rank}"), self.heartbeat_endpoint)
        except BaseException:
            self.close()
            raise
        self._lost_at: float | None = None
        self._start_watch(watched)
        self.send(PeerReady(rank))

    def _on_lost(self, frames: list[bytes]) -> None:
        with self._lock:
            if self._lost_at is None:
                self._lost_at = time.monotonic()

    def silence(self) -> float:
        """Seconds since libzmq closed the connection to the coordinator (0 while it is up)."""
        with self._lock:
            return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    def coordinator_alive(self) -> bool:
        with self._lock:
            return self._lost_at is None

    def check_coordinator(self) -> None:
        if not self.coordinator_alive():
            raise CoordinatorLost(f"control plane: rank {self.rank} lost its connection to the "
                                  f"coordinator (dead, or silent for more than "
                                  f"{self.config.heartbeat_timeout_s} s)")

    def send(self, msg: Any) -> None:
        self.send_bytes(encode(msg))

    def send_bytes(self, payload: bytes) -> None:
        try:
            self._sock.send(payload, copy=len(payload) < 65536)
        except zmq.Again as exc:
            raise ControlTimeout(f"control plane: rank {self.rank}: send blocked for "
                                 f"{self.config.send_timeout_s} s") from exc

    def poll(self, timeout: float = 0.0) -> Any | None:
        """Next coordinator message, or None after ``timeout`` seconds; CoordinatorLost once
        the coordinator is silent past the heartbeat timeout and nothing is queued."""
        deadline, wait = time.monotonic() + max(timeout, 0.0), 0.0
        while True:
            if self._sock.poll(wait * 1000):
                msg = decode(self._sock.recv(zmq.NOBLOCK))
                if not isinstance(msg, Heartbeat):
                    return msg
                wait = 0.0
                continue
            self.check_coordinator()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait = min(left, self.config.heartbeat_interval_s)


def _ignore(frames: list[bytes]) -> None:
    """Nothing is ever sent on a liveness connection; libzmq's pings are not messages."""


def open_control(rank: int, world_size: int, store: dist.Store | None = None,
                 config: ControlConfig | None = None,
                 ready_timeout: float | None = None) -> CoordinatorChannel | PeerChannel:
    """The coordinator role is decided here, once: rank 0 gets a CoordinatorChannel that has
    completed the ready handshake, every other rank a PeerChannel."""
    store = default_store() if store is None else store
    if rank != 0:
        return PeerChannel(store, rank, world_size, config)
    channel = CoordinatorChannel(store, world_size, config)
    try:
        channel.wait_ready(ready_timeout)
    except BaseException:
        channel.close()
        raise
    return channel


__all__ = [
    "ControlConfig", "ControlError", "ControlTimeout", "CoordinatorChannel", "CoordinatorLost",
    "Heartbeat", "PeerChannel", "PeerError", "PeerFailed", "PeerLost", "PeerReady", "Shutdown",
    "StepDone", "default_host", "default_store", "open_control",
]
