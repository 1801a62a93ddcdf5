"""Run a picklable function on N local processes joined by a real gloo process group.

``run_ranks(fn, world, *args)`` starts ``world`` fresh interpreters (``python -m
tests.distributed.harness``), each of which joins a gloo group through a TCPStore that this
process hosts on 127.0.0.1 with an OS-assigned port (port 0: nothing to collide with under
pytest-xdist), calls ``fn(*args)`` with the group initialised (``collectives.groups
.world_group()`` returns it) and sends back the pickled result. It returns the results in
rank order, or raises ``RankFailed`` with the traceback of the first rank that failed, or
``TimeoutError`` after ``timeout_s`` (all children are killed; nothing is left running).

``fn`` must be a module-level function of an importable module (pickled by reference),
and its result picklable (tensors are fine: they travel as pickled bytes, not shared memory).
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.devices import CPU_ONLY

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 5.0
"""After one rank fails, how long the others get to finish or fail on their own."""


class RankFailed(RuntimeError):
    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 120.0,
    group_timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """fn(*args) on `world` gloo ranks; returns [result of rank 0, ..., rank world - 1]."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=group_timeout_s),
    )
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        work = Path(tmp)
        (work / "call.pkl").write_bytes(pickle.dumps((fn, args, group_timeout_s)))
        # Ranks run on the CPU with the Triton interpreter, even on a GPU host (tests/devices.py).
        child_env = {**os.environ, **CPU_ONLY, **(env or {})}
        child_env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), child_env.get("PYTHONPATH", "")]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        procs = []
        for rank in range(world):
            log = open(work / f"rank{rank}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.distributed.harness", str(work), str(rank)],
                    cwd=ROOT, env={**child_env, "RANK": str(rank)}, stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
        try:
            finished = _wait(procs, time.monotonic() + timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        reports = [_report(work, r) for r in range(world)]
        failures = [(rep[2], r) for r, rep in enumerate(reports) if rep[0] != "ok"]
        if failures:
            rank = min(failures)[1]  # the earliest failure; later ones are usually echoes
            raise RankFailed(rank, f"{reports[rank][1]}\n{_logs(work, world)}")
        if not finished:
            raise TimeoutError(f"ranks still running after {timeout_s} s:\n{_logs(work, world)}")
        return [rep[1] for rep in reports]


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every child; after the first failure the others get GRACE_S to finish.
    True when all exited in time."""
    grace_end = deadline
    while time.monotonic() < min(deadline, grace_end):
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return True
        if grace_end == deadline and any(c not in (None, 0) for c in codes):
            grace_end = time.monotonic() + GRACE_S
        time.sleep(0.02)
    return False


def _report(work: Path, rank: int) -> tuple[str, Any, float]:
    """(status, result or traceback, time of failure) of one rank."""
    out = work / f"rank{rank}.out"
    if out.exists():
        return pickle.loads(out.read_bytes())
    return "err", f"(rank {rank} left no result: killed or crashed)", math.inf


def _logs(work: Path, world: int) -> str:
    parts = []
    for r in range(world):
        text = (work / f"rank{r}.log").read_bytes().decode(errors="replace")
        parts.append(f"--- rank {r} output (tail) ---\n{text[-3000:]}")
    return "\n".join(parts)


def _child(work: Path, rank: int) -> int:
    fn, args, group_timeout_s = pickle.loads((work / "call.pkl").read_bytes())
    world = int(os.environ["WORLD_SIZE"])
    status, payload, code, failed_at = "ok", None, 0, math.inf
    try:
        import torch

        torch.set_num_threads(1)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1,
            is_master=False, timeout=datetime.timedelta(seconds=group_timeout_s),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=group_timeout_s),
        )
        payload = fn(*args)
    except BaseException:  # reported to the parent
        status, payload, code, failed_at = "err", traceback.format_exc(), 1, time.time()
    try:
        (work / f"rank{rank}.out").write_bytes(pickle.dumps((status, payload, failed_at)))
    except Exception:  # an unpicklable result is a failure too
        text = traceback.format_exc()
        (work / f"rank{rank}.out").write_bytes(pickle.dumps(("err", text, time.time())))
        code = 1
    if dist.is_initialized() and code == 0:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    status = _child(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown: a failed rank must not hang on gloo threads
