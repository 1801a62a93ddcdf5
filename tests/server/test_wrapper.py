"""`helios-serve --tp 2` starts torchrun, which serves the embedded model on two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from launch.tiny_model import ensure_tiny_model
from tests.devices import rank_env, skip_without_gpus
from tests.distributed.launcher import ROOT, free_port
from tests.server.helpers import (
    TOLERANCE,
    check_natural,
    encoder,
    hf_rows,
    natural_from_dict,
    token_id_of,
)


def test_helios_serve_wrapper_runs_two_ranks(tmp_path):
    skip_without_gpus(2)
    model_dir = ensure_tiny_model(tmp_path / "cache")
    port = free_port()
    env = {**rank_env(2), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
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
        prompt_ids = encoder(model_dir).encode("The garden").ids
        body = {"model": model_dir.name, "prompt": prompt_ids, "max_tokens": 3,
                "temperature": 0.0, "logprobs": 2, "ignore_eos": True,
                "return_tokens_as_token_ids": True}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        lp = out["choices"][0]["logprobs"]
        generated = [token_id_of(t) for t in lp["tokens"]]
        assert len(generated) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
        # The TP2 job's values against transformers on the same checkpoint.
        rows = hf_rows(model_dir, prompt_ids, generated)
        for j, token_id in enumerate(generated):
            assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
            assert float(rows[j, token_id]) >= float(rows[j].max()) - TOLERANCE  # greedy
            check_natural(natural_from_dict(lp["top_logprobs"][j], token_id, 2), rows[j], 2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
