"""A peer that dies or hangs mid-generation: in-flight requests fail clearly, the job exits
non-zero, and nothing hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.checkpoints import write_llama
from tests.distributed.launcher import start_ranks, stop

BUSY_CPU_S = 0.1
"""Peer CPU time after the coordinator is ready that shows steps running: an idle peer only
heartbeats; the three requests, batched, take 480 steps of a few milliseconds each."""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_cpu(pid: int, seconds: float, deadline: float) -> None:
    start = cpu_seconds(pid)
    while cpu_seconds(pid) - start < seconds:
        assert time.monotonic() < deadline, "the peer never started serving steps"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_lost_peer_fails_in_flight_requests_without_hanging(tmp_path, sig):
    model_dir = write_llama(tmp_path / "llama")
    reqs = [{"prompt_ids": [5, 6, 7], "params": {"max_tokens": 480, "temperature": 0.0,
                                                  "ignore_eos": True, "logprobs": 2}}] * 3
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    out = tmp_path / "out.json"
    args = ["--model", str(model_dir), "--requests", str(tmp_path / "req.json"),
            "--output", str(out), "--capacity", "4", "--max-model-len", "500",
            "--heartbeat-timeout", "3", "--log-level", "ERROR"]
    procs = start_ranks("helios_logprobs.launch.generate", args, 2, stderr=subprocess.PIPE)
    try:
        coordinator, peer = procs
        deadline = time.monotonic() + 120
        while b"engine ready" not in coordinator.stderr.readline():
            assert time.monotonic() < deadline, "coordinator never became ready"
            assert coordinator.poll() is None, "coordinator exited early"
        # Mid-generation: the peer computes only while serving plans, so CPU time it spends
        # after the coordinator is ready means steps are running (no sleep to guess it).
        wait_for_cpu(peer.pid, BUSY_CPU_S, deadline)
        assert out.exists() is False, "the requests finished before the peer was lost"
        peer.send_signal(sig)
        code = coordinator.wait(timeout=90)  # nothing hangs: the job ends on its own
        assert code != 0
        results = json.loads(out.read_text())["results"]
        assert len(results) == len(reqs)
        assert all("request failed" in r["error"]["message"] for r in results), results
        if sig == signal.SIGSTOP:
            # A hung peer is noticed by the heartbeat; the coordinator ends the job itself.
            text = coordinator.stderr.read().decode(errors="replace")
            assert "stopped answering" in text, text[-2000:]
    finally:
        if peer.poll() is None:
            peer.send_signal(signal.SIGCONT)
        stop(procs)
