"""Start N ranks of a module directly, in the environment torchrun would give them.

As under torchrun, the launching process (here, the test) hosts the rendezvous TCPStore on an
OS-assigned port (port 0: nothing another process can take first) and every rank joins it as
a client (``TORCHELASTIC_USE_AGENT_STORE=True``, read by ``init_method="env://"``).
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from tests.devices import rank_env, skip_without_gpus

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that was free a moment ago (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(list):
    """The rank processes, in rank order; holds the rendezvous store while they run."""

    store: dist.TCPStore | None = None


def start_ranks(module: str, args: list[str], world: int, **popen) -> Ranks:
    """Skips the test when the ranks cannot run on this host (tests/devices.py)."""
    skip_without_gpus(world)
    procs = Ranks()
    if world > 1:
        procs.store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=120))
    port = procs.store.port if procs.store is not None else 0
    for rank in range(world):
        env = {
            **rank_env(world),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"test-{port}",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
        }
        if world == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT",
                        "TORCHELASTIC_USE_AGENT_STORE"):
                env.pop(key)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                      cwd=ROOT, **popen))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def run_ranks(module: str, args: list[str], world: int, timeout: float = 240) -> None:
    procs = start_ranks(module, args, world, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        outputs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        stop(procs)
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"ranks failed {failed}:\n" + "\n".join(o[-3000:] for o in outputs))
