"""Liveness that cannot be starved: libzmq's own heartbeats keep a rank that is busy in
Python (holding the interpreter lock for several heartbeat timeouts) alive to its peers,
while a SIGSTOPped rank is still noticed, from either side."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch.distributed as dist

from helios_logprobs.collectives.control import (
    ControlConfig,
    CoordinatorChannel,
    PeerChannel,
    Shutdown,
    StepDone,
)

pytestmark = pytest.mark.slow
SPAWN = mp.get_context("spawn")
TIMEOUT_S = 1.5
"""Heartbeat timeout: the busy phases below hold the interpreter lock for 3x as long."""


def config(job: str) -> ControlConfig:
    return ControlConfig(job_id=job, host="127.0.0.1", heartbeat_interval_s=0.1,
                         heartbeat_timeout_s=TIMEOUT_S, connect_timeout_s=30.0)


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


def hold_the_interpreter(seconds: float) -> None:
    """Pure Python for ``seconds``: no other Python thread of this process gets to run for
    long stretches (the switch interval is raised so the loop keeps the lock)."""
    import sys

    sys.setswitchinterval(seconds)
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    sys.setswitchinterval(0.005)


def busy_coordinator(port: int, job: str, done) -> None:
    with CoordinatorChannel(client(port), 2, config(job)) as channel:
        channel.wait_ready(30.0)
        hold_the_interpreter(3 * TIMEOUT_S)
        channel.send(1, Shutdown("still here"))
        done.wait(30)


def busy_peer(port: int, job: str, done) -> None:
    with PeerChannel(client(port), 1, 2, config(job)) as channel:
        hold_the_interpreter(3 * TIMEOUT_S)
        channel.send(StepDone(1, 7))
        done.wait(30)


def idle_peer(port: int, job: str, result) -> None:
    with PeerChannel(client(port), 1, 2, config(job)) as channel:
        try:
            result.put(("message", channel.recv(60.0).reason))
            while True:
                channel.poll(0.2)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result.put(("lost", type(exc).__name__, time.monotonic()))


def test_a_busy_coordinator_stays_alive_and_a_stopped_one_is_noticed():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    done, result = SPAWN.Event(), SPAWN.Queue()
    coordinator = SPAWN.Process(target=busy_coordinator, args=(store.port, "busy-c", done))
    peer = SPAWN.Process(target=idle_peer, args=(store.port, "busy-c", result))
    coordinator.start()
    peer.start()
    try:
        # The peer polls throughout the coordinator's busy phase and still gets the message.
        assert result.get(timeout=60) == ("message", "still here")
        os.kill(coordinator.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        kind, error, at = result.get(timeout=30)
        assert (kind, error) == ("lost", "CoordinatorLost")
        assert at - stopped < 10 * TIMEOUT_S
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
        done.set()
        for proc in (peer, coordinator):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def test_a_busy_peer_stays_alive_and_a_stopped_one_is_noticed():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    done = SPAWN.Event()
    peer = SPAWN.Process(target=busy_peer, args=(store.port, "busy-p", done))
    peer.start()
    try:
        with CoordinatorChannel(store, 2, config("busy-p")) as channel:
            channel.wait_ready(30.0)
            rank, msg = channel.recv(60.0)  # raises PeerLost if the busy peer were dropped
            assert (rank, msg) == (1, StepDone(1, 7))
            assert channel.dead_peers() == ()
            os.kill(peer.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            while not channel.dead_peers():
                assert time.monotonic() - stopped < 10 * TIMEOUT_S, "a stopped peer went unseen"
                time.sleep(0.05)
            assert channel.dead_peers() == (1,)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        done.set()
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
