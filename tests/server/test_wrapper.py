"""`helios-serve --tp 2` starts torchrun, which serves the embedded model on two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from launch.tiny_model import ensure_tiny_model
from tests.distributed.launcher import ROOT, free_port


def test_helios_serve_wrapper_runs_two_ranks(tmp_path):
    model_dir = ensure_tiny_model(tmp_path / "cache")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.wrapper", "--tp", "2", "--model", str(model_dir),
         "--port", str(port), "--capacity", "2"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the wrapper exited before serving"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became healthy"
            time.sleep(0.5)
        body = {"model": model_dir.name, "prompt": "The garden", "max_tokens": 3,
                "temperature": 0.0, "logprobs": 2}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3
        assert all(v <= 0.0 for v in lp["token_logprobs"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
