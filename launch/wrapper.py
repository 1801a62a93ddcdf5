"""`helios-serve --tp N [serve args]`: start the server at tensor-parallel degree N.

`-tp N` / `--tensor-parallel-size N` (vLLM's names) are the same flag. The whole command line
is checked here first (a refused one: one `helios: error: ...` line, exit status 2, before
any process starts) and passed on unchanged; a positional MODEL is `--model MODEL`.

N > 1 runs torchrun in this process (`torch.distributed.run --standalone --nproc-per-node N
-m helios_logprobs.launch.serve [serve args]`), so signals reach torchrun directly, which
forwards them to its workers. Unlike a bare `torchrun`, a stop is quiet: torchrun's start-up
banner and shutdown warnings are off (LOGLEVEL=ERROR unless set), a SIGINT/SIGTERM/SIGHUP ends
with status 0 instead of torchrun's SignalException traceback, a start-up refusal is rank
0's one `helios: error: ...` line with exit status 2 (no torchrun summary), and any other
failed rank is reported by torchrun's summary without the launcher's own traceback (status
1). N = 1 execs
`python -m helios_logprobs.launch.serve [serve args]` without torchrun. Every other argument
goes to launch.serve unchanged (see `python -m helios_logprobs.launch.serve --help`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from helios_logprobs.collectives.torchrun import run_torchrun as run_torchrun_main
from helios_logprobs.launch.serve_options import parse_serve_args

STARTUP_REFUSED = 2
"""launch.serve's exit status for a start-up refusal (its one `helios: error:` line)."""
WORKERS_GRACE_S = 20.0
"""After a repeated stop signal, how long the workers get before SIGKILL (more than a rank's
own deadline, launch.signals.STOP_GRACE_S)."""


def parse(argv: list[str] | None = None) -> tuple[int, list[str]]:
    """The tensor-parallel degree and launch.serve's arguments (the whole command line, checked
    with launch.serve's own parser: no torch is imported for --help or a refusal)."""
    rest = list(sys.argv[1:] if argv is None else argv)
    args = parse_serve_args(rest, prog="helios-serve", description=__doc__)
    return args.tensor_parallel_size or 1, rest


def torchrun_args(tp: int, rest: list[str]) -> list[str]:
    return ["--standalone", f"--nproc-per-node={tp}", "-m", "helios_logprobs.launch.serve", *rest]


def command(argv: list[str] | None = None) -> list[str]:
    """The equivalent command line (what N = 1 execs; N > 1 runs it in this process)."""
    tp, rest = parse(argv)
    if tp == 1:
        return [sys.executable, "-m", "helios_logprobs.launch.serve", *rest]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(tp, rest)]


def _stop_before_workers(signum: int, frame: object) -> None:
    """A stop signal before torchrun installs its own handlers, which it does before it
    starts any worker: nothing to clean up yet."""
    os.write(2, f"helios: shutting down ({signal.Signals(signum).name})\n".encode())
    os._exit(0)


def run_torchrun(args: list[str]) -> int:
    """torchrun's main in this process; returns the exit status (see the module docstring)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_before_workers)
    # What torchrun sets for more than one local worker anyway, minus its banner saying so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    end = run_torchrun_main(args)
    if end.signal is not None:
        # torchrun has forwarded the signal and waited for its workers (rank 0 announced the
        # stop: "helios: shutting down (...)"), unless a repeat cut that wait short.
        return finish_workers(end.signal)
    if end.exit_code == STARTUP_REFUSED:
        return STARTUP_REFUSED  # rank 0 has said why, in one line
    if end.failure is not None:
        print(end.failure, file=sys.stderr, flush=True)
        return 1
    return 0

def workers() -> list[int]:
    """This process's children: torchrun's workers."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            pids += [int(pid) for pid in Path(f"/proc/self/task/{task}/children").read_text()
                     .split()]
        except OSError:
            continue
    return pids


def finish_workers(sig: int, timeout_s: float = WORKERS_GRACE_S) -> int:
    """Forward a repeated stop signal that ended torchrun's wait (a forced stop: requests in
    flight fail at once) and wait for the workers; SIGKILL after ``timeout_s``. 0, or 1 when
    they had to be killed."""
    left = workers()
    if not left:
        return 0

    def forward(signum: int, frame: object) -> None:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    for stop_sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_sig, forward)
    forward(sig, None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in list(left):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            left.remove(pid)
        if not left:
            return 0
        time.sleep(0.1)
    forward(signal.SIGKILL, None)
    return 1


def main(argv: list[str] | None = None) -> int:
    tp, rest = parse(argv)
    if tp == 1:
        cmd = command(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(cmd[0], cmd)
    return run_torchrun(torchrun_args(tp, rest))


if __name__ == "__main__":
    sys.exit(main())
