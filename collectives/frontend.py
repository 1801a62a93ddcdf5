"""The ZeroMQ sockets between the engine core and its API server processes (IPC on one
host). The core binds one PULL socket for every API server's requests and one PUSH socket
per API server for its outputs; both directions hold at most ``hwm`` messages (ZeroMQ's
high-water marks), so a process that stops reading makes its sender wait (back-pressure)
instead of buffering without bound. Payloads are collectives.codec messages."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

DEFAULT_HWM = 64
"""Messages queued per direction and socket (a message is one step's outputs)."""


def input_address(directory: str | Path) -> str:
    return f"ipc://{Path(directory) / 'input'}"


def output_address(directory: str | Path, index: int) -> str:
    return f"ipc://{Path(directory) / f'output-{index}'}"


class CoreSockets:
    """The engine core's side. ``receive`` on one thread; ``send`` from any (locked)."""

    def __init__(self, directory: str | Path, count: int, hwm: int = DEFAULT_HWM,
                 send_timeout_ms: int = 30_000) -> None:
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, hwm)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.bind(input_address(directory))
        self.outputs: list[zmq.Socket | None] = []
        for index in range(count):
            out = self.context.socket(zmq.PUSH)
            out.setsockopt(zmq.SNDHWM, hwm)
            out.setsockopt(zmq.LINGER, 0)
            out.bind(output_address(directory, index))
            self.outputs.append(out)
        self.lock = threading.Lock()
        self.send_timeout_ms = send_timeout_ms

    def receive(self, timeout_ms: int) -> bytes | None:
        if not self.input.poll(timeout_ms):
            return None
        return self.input.recv(copy=True)

    def send(self, index: int, data: bytes, timeout_ms: int | None = None) -> bool:
        """False when API server ``index`` is gone or did not take the message within
        ``timeout_ms`` (default: the send timeout; 0: only if it fits now). The lock is
        released between tries, so a waiting send never holds up ``drop``."""
        wait_s = (self.send_timeout_ms if timeout_ms is None else timeout_ms) / 1000
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            with self.lock:
                out = self.outputs[index]
                if out is None:
                    return False
                try:
                    out.send(data, zmq.NOBLOCK, copy=False)
                    return True
                except zmq.Again:
                    pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def drop(self, index: int) -> None:
        with self.lock:
            out, self.outputs[index] = self.outputs[index], None
            if out is not None:
                out.close(linger=0)

    def close(self) -> None:
        for index in range(len(self.outputs)):
            self.drop(index)
        self.input.close(linger=0)
        self.context.term()


class ServerSockets:
    """One API server's side. ``receive`` on one thread; ``send`` from any (locked)."""

    def __init__(self, directory: str | Path, index: int, hwm: int = DEFAULT_HWM,
                 send_timeout_ms: int = 1_000) -> None:
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, hwm)
        self.input.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_address(directory))
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, hwm)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.connect(output_address(directory, index))
        self.lock = threading.Lock()

    def send(self, data: bytes) -> bool:
        """False when the core did not take the message within the send timeout (it is gone,
        or ``hwm`` messages already wait for it)."""
        with self.lock:
            try:
                self.input.send(data, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            try:
                self.input.send(data, copy=False)
                return True
            except zmq.Again:
                return False

    def receive(self, timeout_ms: int) -> bytes | None:
        if not self.output.poll(timeout_ms):
            return None
        return self.output.recv(copy=True)

    def close(self) -> None:
        with self.lock:
            self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
