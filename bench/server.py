"""Starting and stopping a local server for the benchmarks that go through HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def package_shim(root: Path) -> Path:
    """A folder that makes ``helios_logprobs`` import from the checkout ``root`` (e.g. a
    `git worktree` of an older commit) ahead of this checkout's editable install."""
    shim = Path(tempfile.gettempdir()) / f"helios-shim-{abs(hash(str(root.resolve())))}"
    package = shim / "helios_logprobs"
    package.mkdir(parents=True, exist_ok=True)
    for folder in ("runtime", "ranks", "kernels", "collectives", "launch"):
        link = package / folder
        if not link.is_symlink():
            link.symlink_to(root.resolve() / folder)
    return shim


def start_server(serve_args: list[str], timeout_s: float = 300.0,
                 root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m helios_logprobs.launch.serve` on a free loopback port with ``serve_args``
    (from the checkout ``root``: default this one); (process, URL) once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "helios_logprobs.launch.serve", "--host", "127.0.0.1",
           "--port", str(port), *serve_args]
    path = str(ROOT) if root is None else f"{package_shim(root)}{os.pathsep}{root}"
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
