"""launch/: the start-up line, load progress, and a quiet stop of every rank.

A real TP2 job (helios-serve, which runs torchrun in its own process) prints one start-up line
once it listens; SIGINT to its process group (a terminal's Ctrl-C) or SIGTERM to rank 1 alone
ends every process within seconds, with status 0, one shutdown line and no traceback.
"""

from __future__ import annotations

import io
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helios_logprobs.launch.cluster import ProgressLine
from helios_logprobs.launch.serve import ready_line
from helios_logprobs.ranks.model import ShardedCausalLM
from tests.server.helpers import Server, descendants, launch, write_model

STOP_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("lifecycle") / "model", "byte_level")


# ----------------------------------------------------------------- formats, no processes
def test_ready_line():
    assert ready_line("tiny-llama-v1", "127.0.0.1", 8000, 2, 20, False) == (
        "serving tiny-llama-v1 at http://127.0.0.1:8000/v1 "
        "(TP=2, logprobs: K=20, prompt scoring: off)"
    )
    assert ready_line("m", "::1", 80, 1, 0, True) == (
        "serving m at http://[::1]:80/v1 (TP=1, logprobs: off, prompt scoring: on)"
    )
    assert ready_line("m", "h", 80, 1, 20, False, "bfloat16 (--dtype)") == (
        "serving m at http://h:80/v1 (TP=1, logprobs: K=20, prompt scoring: off, "
        "dtype: bfloat16 (--dtype))"
    )


def test_progress_on_a_terminal_is_one_line_redrawn_then_erased():
    out = io.StringIO()
    progress = ProgressLine(out, tty=True)
    progress(1, 4)
    progress.close()
    text = out.getvalue()
    assert text.startswith("\r\033[Khelios: loading weights 25% (")
    assert text.endswith("\r\033[K") and "\n" not in text


def test_progress_in_a_log_is_silent_for_a_fast_load():
    out = io.StringIO()
    progress = ProgressLine(out, tty=False)
    for done in range(1, 5):
        progress(done, 4)
    progress.close()
    assert out.getvalue() == ""


def test_progress_in_a_log_reports_a_slow_load():
    out = io.StringIO()
    progress = ProgressLine(out, tty=False)
    progress.start -= ProgressLine.FIRST_S + 1  # as if the load began six seconds ago
    progress(2, 4)
    progress(3, 4)  # within EVERY_S of the last line: nothing
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("helios: loading weights 50% (")
    assert lines[1].startswith("helios: loaded weights in ")


def test_load_reports_every_part(model_dir):
    calls: list[tuple[int, int]] = []
    model = ShardedCausalLM.load(model_dir, progress=lambda *call: calls.append(call))
    total = model.config.num_hidden_layers + 2
    assert calls == [(done, total) for done in range(1, total + 1)]


# ----------------------------------------------------------------- a real TP2 job
def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def rank_pid(server: Server, rank: int) -> int:
    for pid in descendants(server.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise LookupError(f"no rank {rank} under {server.pid}:\n{server.log_tail()}")


def serve_then_stop(model_dir: Path, log_dir: Path,
                    send: Callable[[Server], None]) -> tuple[int, str, float]:
    """Start `helios-serve --tp 2`, check its start-up line, ``send`` it a signal; returns the
    exit status, the whole output and how long every process took to go."""
    server = launch(
        "lifecycle", model_dir, 2, [], log_dir,
        command=lambda port: ["-m", "helios_logprobs.launch.wrapper", "--tp", "2",
                              "--model", str(model_dir), "--served-model-name", "launch-test",
                              "--port", str(port),
                              "--capacity", "2", "--max-model-len", "256"],
    )
    try:
        server.wait_healthy()
        # Written before uvicorn serves its first request, so it is there once /health is 200.
        ready = [line for line in server.log_path.read_text().splitlines()
                 if line.startswith("helios: serving")]
        assert ready == [f"helios: serving launch-test at http://127.0.0.1:{server.port}/v1 "
                         "(TP=2, logprobs: K=20, prompt scoring: off, dtype: float32 (auto: "
                         "the exact choice on CPU))"], server.log_tail()
        pids = {server.pid} | descendants(server.pid)
        assert len(pids) >= 3, pids  # torchrun and two ranks
        sent = time.monotonic()
        send(server)
        status = server.proc.wait(timeout=STOP_WITHIN_S + 5)
        while any(alive(pid) for pid in pids) and time.monotonic() - sent < STOP_WITHIN_S:
            time.sleep(0.1)
        took = time.monotonic() - sent
        assert not [pid for pid in pids if alive(pid)], server.log_tail()
        return status, server.log_path.read_text(errors="replace"), took
    finally:
        server.stop()


ACCESS_LINE = re.compile(r'^INFO: +\S+ - "GET /health HTTP/1\.1" 200 OK$')
"""uvicorn's access log line for the helper's health checks."""


def assert_quiet_stop(status: int, output: str, took: float, reason: str) -> None:
    assert status == 0, output
    assert took < STOP_WITHIN_S, output
    assert "Traceback" not in output, output
    helios = [line for line in output.splitlines() if line.startswith("helios:")]
    # The start-up lines (ready, then the capacity summary), then exactly one shutdown line.
    assert helios[0].startswith("helios: serving "), output
    assert [line for line in helios[1:] if not line.startswith("helios: frames ")] == [
        f"helios: shutting down ({reason})"], output
    assert output.count("shutting down") == 1, output


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line(model_dir, tmp_path):
    status, output, took = serve_then_stop(
        model_dir, tmp_path, lambda server: os.killpg(server.pid, signal.SIGINT))
    assert_quiet_stop(status, output, took, "SIGINT")
    # Nothing but the two lines and the access log (on by default, as vLLM's): no torchrun
    # banner, warnings or summary either.
    assert [line for line in output.splitlines()
            if not line.startswith("helios:") and not ACCESS_LINE.match(line)] == [], output


@pytest.mark.slow
def test_sigterm_to_a_peer_stops_the_whole_job(model_dir, tmp_path):
    status, output, took = serve_then_stop(
        model_dir, tmp_path, lambda server: os.kill(rank_pid(server, 1), signal.SIGTERM))
    assert_quiet_stop(status, output, took, "SIGTERM on rank 1")
