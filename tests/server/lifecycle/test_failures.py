"""Failures after admission, through the real engine and a real server.

- A checkpoint whose embedding row for one token is NaN: a request whose prompt holds that
  token has non-finite logits. Only that request fails (HTTP 500, or an SSE error event); a
  neighbour in the same batch finishes with transformers' values; the server stays healthy.
- A TP2 server whose rank 1 is SIGKILLed mid-stream: the stream ends with an error event,
  /health turns 503 and the job goes away.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.server.helpers import (
    TOLERANCE,
    Server,
    hf_rows,
    launch,
    post,
    sse_events,
    strict_json,
    token_id_of,
    write_model,
)
from tests.server.processes import rank_pid

pytestmark = pytest.mark.slow

POISON = 77
"""Token whose embedding row is NaN in the poisoned checkpoint."""


def poisoned_model(path: Path) -> Path:
    model_dir = write_model(path, "byte_level")
    weights = load_file(model_dir / "model.safetensors")
    (key,) = [name for name in weights if "embed_tokens" in name]
    weights[key][POISON] = float("nan")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def poisoned_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("poisoned")
    server = launch("poisoned", poisoned_model(root / "model"), 1, ["--capacity", "4"], root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def completion(server: Server, prompt: list[int], **extra) -> dict:
    return {"model": server.model_dir.name, "prompt": prompt, "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True, "logprobs": 3,
            "return_tokens_as_token_ids": True, **extra}


def concurrently(*calls) -> list:
    """Run the calls at the same time (so the engine batches them); their results in order."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def test_non_finite_logits_fail_only_their_request(poisoned_server):
    server = poisoned_server
    good_prompt, bad_prompt = [5, 6, 9, 12], [5, POISON, 9, 12]
    good, bad, bad_stream = concurrently(
        lambda: post(server, "/v1/completions", completion(server, good_prompt)),
        lambda: post(server, "/v1/completions", completion(server, bad_prompt)),
        lambda: post(server, "/v1/completions", completion(server, bad_prompt, stream=True)),
    )
    # The requesting request fails after admission: a 500 naming the cause, never NaN.
    assert bad.status_code == 500, bad.text
    body = strict_json(bad.content)["error"]
    assert body["code"] == 500 and "non-finite" in body["message"]
    # Streaming: the error arrives as an SSE error event, then [DONE].
    assert bad_stream.status_code == 200
    events = sse_events(bad_stream)
    assert events[-1]["error"]["code"] == 500
    assert "non-finite" in events[-1]["error"]["message"]
    # The neighbour in the same batch is untouched: transformers' values on the same weights.
    assert good.status_code == 200, good.text
    lp = strict_json(good.content)["choices"][0]["logprobs"]
    generated = [token_id_of(t) for t in lp["tokens"]]
    assert len(generated) == 6 and POISON not in generated
    rows = hf_rows(server.model_dir, good_prompt, generated)
    for j, token_id in enumerate(generated):
        assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    again = post(server, "/v1/completions", completion(server, good_prompt))
    assert again.status_code == 200
    assert strict_json(again.content)["choices"][0]["logprobs"]["tokens"] == lp["tokens"]


def test_peer_killed_under_a_running_tp2_server(tmp_path):
    model_dir = write_model(tmp_path / "model", "byte_level")
    server = launch("tp2", model_dir, 2, ["--capacity", "2", "--heartbeat-timeout", "10"],
                    tmp_path)
    try:
        server.wait_healthy()
        body = completion(server, [5, 6, 9], max_tokens=200, stream=True)
        first_chunk = threading.Event()
        seen: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as response:
                for line in response.iter_lines():
                    seen.append(line)
                    if line.startswith("data: {"):
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60), "the stream never started"
        os.kill(rank_pid(server.pid, 1), signal.SIGKILL)
        # torchrun tears the job down as soon as a worker dies, so the coordinator may be
        # gone before /health is asked. Until the loss is seen (the stream's next collective,
        # or torchrun's teardown) /health may still answer 200; after it, 503 or nothing.
        # (The 503 window is asserted with a hung peer, which torchrun cannot see.)
        statuses = []
        gone = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and 503 not in statuses:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                gone = True  # the job is already gone
                break
            time.sleep(0.05)
        assert gone or statuses[-1] == 503, statuses  # never healthy for long
        reader.join(timeout=60)
        assert not reader.is_alive(), "the stream never ended after the peer died"
        events = [strict_json(line[6:]) for line in seen
                  if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 500, events[-1]
        assert [line for line in seen if line][-1] == "data: [DONE]"
        assert len(events) < 200  # it did not run to the end
        deadline = time.monotonic() + 60
        while server.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.running(), "the job outlived its lost peer"
    finally:
        server.stop()


def test_poisoned_weights_are_really_non_finite(tmp_path):
    """Guards the fixture: transformers itself gives NaN rows after the poisoned token."""
    model_dir = poisoned_model(tmp_path / "model")
    rows = hf_rows(model_dir, [5, POISON, 9], [12])
    assert torch.isnan(rows).any()


def test_a_hung_peer_ends_the_whole_job_within_seconds(tmp_path):
    """Supervisor-friendly exit: with rank 1 SIGSTOPped, the coordinator notices after the
    heartbeat timeout, fails its requests and ends the job: torchrun and every rank are gone
    within a few seconds (torchrun alone would wait ~30 s on the stopped process)."""
    model_dir = write_model(tmp_path / "model", "byte_level")
    server = launch("tp2-hung", model_dir, 2, ["--capacity", "2", "--heartbeat-timeout", "2"],
                    tmp_path)
    stopped = None
    try:
        server.wait_healthy()
        stopped = rank_pid(server.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        statuses: list[int] = []
        while server.running() and time.monotonic() - started < 60:
            try:
                statuses.append(httpx.get(server.url + "/health", timeout=1).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        # Between noticing the hung peer and exiting, the coordinator reports itself
        # unhealthy (it waits a grace period so that clients see the failure).
        assert 503 in statuses, statuses[-20:]
        elapsed = time.monotonic() - started
        assert not server.running(), "the job outlived its hung peer by a minute"
        assert elapsed < 20, f"the job took {elapsed:.1f} s to go away"
        # (the whole log: the API server's access lines and torchrun's report come after it)
        assert "stopped answering" in server.log_path.read_text(errors="replace")
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
