"""The control plane with real processes, real ZeroMQ sockets and a real TCPStore / gloo group.

Peers (and, for one test, the coordinator) run in ``spawn``ed processes that the tests start
and always stop; the process-group test runs through ``tests.distributed.harness``. Every
wait is bounded; ports come from the OS (TCPStore port 0 and ``bind_to_random_port``), so
the tests can run in parallel under xdist.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time
import uuid
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from helios_logprobs.collectives.codec import CodecError, message
from helios_logprobs.collectives.control import (
    ControlConfig,
    ControlTimeout,
    CoordinatorChannel,
    CoordinatorLost,
    PeerChannel,
    PeerError,
    PeerLost,
    PeerReady,
    Shutdown,
    StepDone,
    default_host,
    open_control,
)
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow
SPAWN = mp.get_context("spawn")
HB_TIMEOUT = 4.0
"""Twenty heartbeat intervals: a peer starved for a few seconds on a loaded machine is not
declared dead. The checks below assert what happens and in which order, with bounds far
from any scheduling delay (a lost peer is noticed in seconds, not gloo's 30 minutes)."""
NOTICED_WITHIN_S = 60.0


@message("test.control.plan")
@dataclass(frozen=True, eq=False)
class Plan:
    submission: int
    tokens: torch.Tensor
    scores: torch.Tensor


def _plan(submission: int) -> Plan:
    tokens = torch.arange(submission, submission + 64, dtype=torch.int64).reshape(8, 8)
    scores = torch.tensor([float("nan"), -0.0, float("inf"), submission / 3], dtype=torch.float32)
    return Plan(submission, tokens, scores.to(torch.bfloat16))


def _plan_ok(msg: Plan) -> bool:
    want = _plan(msg.submission)
    return torch.equal(msg.tokens, want.tokens) and torch.equal(
        msg.scores.view(torch.int16), want.scores.view(torch.int16))


def _config(job_id: str, host: str | None = "127.0.0.1") -> ControlConfig:
    return ControlConfig(job_id=job_id, host=host, heartbeat_interval_s=0.2,
                         heartbeat_timeout_s=HB_TIMEOUT, connect_timeout_s=30.0,
                         send_timeout_s=5.0)


def _client_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


def _serve(channel: PeerChannel, garbage_first: bool = False) -> int:
    """Peer loop: check each Plan (order, payload), reply StepDone or PeerError; returns the
    number of plans served when told to shut down."""
    if garbage_first:
        channel.send_bytes(b"\xc1 this is not msgpack")
    expected = 0
    while True:
        try:
            msg = channel.recv(timeout=30.0)
        except CodecError as exc:
            channel.send(PeerError(channel.rank, f"codec: {exc}"))
            continue
        if isinstance(msg, Shutdown):
            return expected
        if isinstance(msg, Plan) and msg.submission == expected and _plan_ok(msg):
            channel.send(StepDone(channel.rank, msg.submission))
            expected += 1
        else:
            channel.send(PeerError(channel.rank, f"unexpected {msg!r:.60} at {expected}"))


def _peer_main(port: int, rank: int, world: int, job_id: str, garbage_first: bool) -> None:
    torch.set_num_threads(1)
    with PeerChannel(_client_store(port), rank, world, _config(job_id)) as channel:
        _serve(channel, garbage_first)


def _coordinator_main(port: int, world: int, job_id: str) -> None:
    """Coordinator in a child: one plan, then idles (heartbeating) until killed."""
    with CoordinatorChannel(_client_store(port), world, _config(job_id)) as channel:
        channel.wait_ready(30.0)
        channel.broadcast(_plan(0))
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            channel.poll(0.5, check=False)


def _gloo_rank(job_id: str) -> object:
    """Run by tests.distributed.harness on a real gloo group (MASTER_ADDR=127.0.0.1):
    open_control on the default store, default host."""
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = open_control(rank, world, config=_config(job_id, host=None), ready_timeout=30.0)
    with channel:
        if isinstance(channel, PeerChannel):
            result: object = _serve(channel)
        else:
            for s in range(20):
                channel.broadcast(_plan(s))
            result = [sorted((r, m.submission) for r, m in channel.gather(StepDone, 20.0).items())
                      for s in range(20)]
            channel.shutdown("done")
            result = (channel.endpoint.rsplit(":", 1)[0], result)
    total = torch.ones(1)
    dist.all_reduce(total)  # the group still works next to the control plane
    return result, total.item()


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield master
    del master


@pytest.fixture
def procs():
    started: list[mp.Process] = []

    def start(target, *args) -> mp.Process:
        proc = SPAWN.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)


def _start_peers(procs, store, world: int, job_id: str, garbage_first: bool = False):
    return {r: procs(_peer_main, store.port, r, world, job_id, garbage_first)
            for r in range(1, world)}


def _join_all(peers, timeout: float = 30.0) -> dict[int, int | None]:
    deadline = time.monotonic() + timeout
    for proc in peers.values():
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    return {r: proc.exitcode for r, proc in peers.items()}


def test_three_peers_ordered_broadcast_replies_and_a_sigkilled_peer(store, procs):
    job = uuid.uuid4().hex
    with CoordinatorChannel(store, 4, _config(job)) as coord:
        assert coord.endpoint.startswith("tcp://127.0.0.1:")
        peers = _start_peers(procs, store, 4, job)
        coord.wait_ready(60.0)
        for s in range(200):  # right after the handshake: nothing may be dropped
            coord.broadcast(_plan(s))
        for s in range(200):
            done = coord.gather(StepDone, 30.0)
            assert sorted(done) == [1, 2, 3]
            assert all(m.submission == s for m in done.values())
        assert coord.poll(0.0) is None
        time.sleep(HB_TIMEOUT + 0.5)  # idle past the timeout: heartbeats keep everyone alive
        assert coord.dead_peers() == () and set(coord.last_seen()) == {1, 2, 3}

        os.kill(peers[2].pid, signal.SIGKILL)
        killed, lost = time.monotonic(), None
        while lost is None and time.monotonic() - killed < NOTICED_WITHIN_S:
            try:
                coord.poll(0.1)
            except PeerLost as exc:
                lost = exc
        assert lost is not None and lost.ranks == (2,), "the SIGKILLed peer was not noticed"
        assert coord.dead_peers() == (2,)
        with pytest.raises(PeerLost) as info:  # its connection is gone: no silent drop
            coord.send(2, _plan(200))
        assert info.value.ranks == (2,)
        for rank in (1, 3):  # the survivors carry on
            coord.send(rank, _plan(200))
        done = coord.gather(StepDone, 30.0, ranks=(1, 3))
        assert {r: m.submission for r, m in done.items()} == {1: 200, 3: 200}
        coord.shutdown("test over")
    assert _join_all(peers) == {1: 0, 2: -signal.SIGKILL, 3: 0}


def test_peer_notices_dead_coordinator(store, procs):
    job = uuid.uuid4().hex
    coordinator = procs(_coordinator_main, store.port, 2, job)
    with PeerChannel(store, 1, 2, _config(job)) as peer:
        msg = peer.recv(60.0)
        assert isinstance(msg, Plan) and msg.submission == 0 and _plan_ok(msg)
        assert peer.poll(HB_TIMEOUT + 0.5) is None  # idle, but heartbeats arrive
        assert peer.coordinator_alive()
        os.kill(coordinator.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(CoordinatorLost):
            while time.monotonic() - killed < NOTICED_WITHIN_S:
                peer.poll(0.2)
        assert not peer.coordinator_alive()


def test_malformed_messages_raise_codec_error_and_channels_survive(store, procs):
    job = uuid.uuid4().hex
    with CoordinatorChannel(store, 2, _config(job)) as coord:
        peers = _start_peers(procs, store, 2, job, garbage_first=True)
        coord.wait_ready(60.0)
        with pytest.raises(CodecError, match="from rank 1"):
            coord.poll(10.0)
        coord.broadcast_bytes(b"\x92\xd4\x63")  # truncated msgpack to the peer
        rank, err = coord.recv(10.0)
        assert rank == 1 and isinstance(err, PeerError) and err.message.startswith("codec:")
        coord.broadcast(_plan(0))
        assert coord.recv(10.0) == (1, StepDone(1, 0))
        coord.shutdown()
    assert _join_all(peers) == {1: 0}


def test_open_control_on_a_gloo_process_group():
    results = run_ranks(_gloo_rank, 3, uuid.uuid4().hex, timeout_s=90.0)
    (host, done), total = results[0]
    assert host == "tcp://127.0.0.1" and total == 3.0
    assert done == [[(1, s), (2, s)] for s in range(20)]
    assert results[1:] == [(20, 3.0), (20, 3.0)]


def test_bounded_waits_without_peers(store):
    job = uuid.uuid4().hex
    with CoordinatorChannel(store, 3, _config(job)) as coord:
        start = time.monotonic()
        with pytest.raises(ControlTimeout, match=r"PeerReady from rank\(s\) \[1, 2\]"):
            coord.wait_ready(0.5)
        assert time.monotonic() - start < 30.0  # bounded by the wait it was given
        assert coord.dead_peers() == () and coord.poll(0.1) is None
    config = ControlConfig(job_id=uuid.uuid4().hex, connect_timeout_s=0.5)
    with pytest.raises(ControlTimeout, match="not in the store"):
        PeerChannel(store, 1, 2, config)


def test_gather_keeps_other_messages_in_order(store):
    job = uuid.uuid4().hex
    with CoordinatorChannel(store, 2, _config(job)) as coord:
        with PeerChannel(store, 1, 2, _config(job)) as peer:
            coord.wait_ready(10.0)
            for s in range(3):
                peer.send(StepDone(1, s))
            peer.send(PeerReady(1))
            assert coord.gather(PeerReady, 10.0) == {1: PeerReady(1)}
            assert [coord.recv(5.0)[1].submission for _ in range(3)] == [0, 1, 2]
            coord.broadcast(Shutdown("bye"))
            assert peer.recv(5.0) == Shutdown("bye")


def test_config_and_host_validation(monkeypatch):
    with pytest.raises(ValueError):
        ControlConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)
    with pytest.raises(ValueError):
        ControlConfig(job_id="a/b")
    with pytest.raises(ValueError):
        PeerChannel(None, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PeerReady(0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert default_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.77")  # TEST-NET, not this host
    assert default_host() != "192.0.2.77"
    monkeypatch.delenv("MASTER_ADDR")
    assert default_host().count(".") == 3
