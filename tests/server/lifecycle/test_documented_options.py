"""Options and refusals that docs/api.md documents, each run against a real server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.http.server import create_app
from tests.server.helpers import (
    MAX_MODEL_LEN,
    ROOT,
    TOLERANCE,
    chat_prompt_ids,
    encoder,
    free_port,
    hf_rows,
    launch,
    post,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
    write_model,
)
from tests.server.processes import rank_pid

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    body = strict_json(response.content)["error"]
    assert body["param"] == param and param in body["message"], body


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"truncation_side": "middle"}, "truncation_side"),
    ("/v1/completions", {"spaces_between_special_tokens": False},
     "spaces_between_special_tokens"),
    ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"stop": [f"s{i}" for i in range(65)]}, "stop"),
])
def test_documented_refusals(server, path, fields, param):
    body = {"model": served_name(server), "max_tokens": 2, **fields}
    body.update(CHAT if "chat" in path else {"prompt": "The garden"})
    refused(post(server, path, body), param)
    # The server stays healthy and serves the next request.
    ok = post(server, "/v1/completions", {"model": served_name(server), "prompt": "a",
                                          "max_tokens": 1})
    assert ok.status_code == 200


def test_prompt_that_leaves_no_room(server):
    name = served_name(server)
    full = [5] * MAX_MODEL_LEN
    refused(post(server, "/v1/completions", {"model": name, "prompt": full}), "prompt")
    refused(post(server, "/v1/completions", {"model": name, "prompt": full[:-1],
                                             "max_tokens": 2}), "max_tokens")
    long_text = "word " * MAX_MODEL_LEN
    refused(post(server, "/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": long_text}]}), "messages")


def test_continuous_usage_stats(server):
    name = served_name(server)
    body = {"model": name, "prompt": "The garden", "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True}
    whole = strict_json(post(server, "/v1/completions", body).content)["usage"]
    events = sse_events(post(server, "/v1/completions", {
        **body, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }))
    chunks, last = events[:-1], events[-1]
    assert last["choices"] == [] and last["usage"] == whole
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == whole["completion_tokens"] == 5
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
    assert all(c["usage"]["total_tokens"] == whole["prompt_tokens"] + c["usage"][
        "completion_tokens"] for c in chunks)


def test_chat_echo_and_multi_part_content(server):
    client, name = server.client(), served_name(server)
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about gardens"}]
    joined = [{"role": "user", "content": "Tell me\nabout gardens"}]
    response = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": parts}], max_tokens=4,
        temperature=0.0, logprobs=True, extra_body={"ignore_eos": True,
                                                   "return_tokens_as_token_ids": True},
    )
    # Text parts are joined with a newline, as vLLM does: same prompt, same tokens.
    prompt_ids = chat_prompt_ids(server.model_dir, joined)
    assert response.usage.prompt_tokens == len(prompt_ids)
    generated = [token_id_of(c.token) for c in response.choices[0].logprobs.content]
    rows = hf_rows(server.model_dir, prompt_ids, generated)
    for j, item in enumerate(response.choices[0].logprobs.content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
    # echo: the response starts with the last message when its role is the response's role.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]
    echoed = client.chat.completions.create(
        model=name, messages=messages, max_tokens=3, temperature=0.0,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True, "ignore_eos": True},
    )
    plain = client.chat.completions.create(
        model=name, messages=messages, max_tokens=3, temperature=0.0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "ignore_eos": True},
    )
    assert echoed.choices[0].message.role == "assistant"
    assert echoed.choices[0].message.content == "The" + plain.choices[0].message.content
    stream = client.chat.completions.create(
        model=name, messages=messages, max_tokens=3, temperature=0.0, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False,
                    "continue_final_message": True, "ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == echoed.choices[0].message.content


def test_chat_without_a_template(tmp_path, model_dirs):
    """A checkpoint without chat_template: chat is a 400 naming messages; completions work."""
    model_dir = tmp_path / "no-template"
    shutil.copytree(model_dirs["byte_level"], model_dir)
    config = (model_dir / "tokenizer_config.json")
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    engine = build_engine(*_rank(model_dir)).start()
    try:
        app = create_app(engine, model_dir, "no-template")

        async def go() -> tuple[httpx.Response, httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                chat = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
                text = await client.post("/v1/completions",
                                         json={"prompt": "Hi", "max_tokens": 2})
                return chat, text

        chat, text = asyncio.run(go())
        refused(chat, "messages")
        assert "chat template" in strict_json(chat.content)["error"]["message"]
        assert text.status_code == 200
    finally:
        engine.shutdown()


def _rank(model_dir: Path) -> tuple[RuntimeConfig, object]:
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=64)
    return config, load_rank(config, None)


def test_helios_serve_tp1_runs_without_torchrun(tmp_path, model_dirs):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    model_dir = model_dirs["byte_level"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "helios_logprobs.launch.wrapper", "--tp", "1",
         "--model", str(model_dir), "--port", str(port), "--capacity", "2",
         "--max-model-len", "64"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "helios-serve --tp 1 exited before serving"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.25)
        # No torchrun: the process that serves is the wrapper's own (exec), rank 0 alone.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"helios_logprobs.launch.serve" in cmdline
        assert b"torch.distributed.run" not in cmdline
        prompt = encoder(model_dir).encode("The garden").ids
        out = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 3, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True, "return_tokens_as_token_ids": True}).json()
        lp = out["choices"][0]["logprobs"]
        generated = [token_id_of(t) for t in lp["tokens"]]
        rows = hf_rows(model_dir, prompt, generated)
        assert len(generated) == 3
        for j, token_id in enumerate(generated):
            assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_collective_timeout_fails_a_hung_peer_before_the_heartbeat(tmp_path):
    """--collective-timeout 3 with a 120 s heartbeat: a SIGSTOPped peer fails the in-flight
    request through the collective's timeout, long before the heartbeat would notice."""
    model_dir = write_model(tmp_path / "model", "byte_level")
    server = launch("tp2-timeout", model_dir, 2, [
        "--capacity", "2", "--collective-timeout", "3", "--heartbeat-timeout", "120"], tmp_path)
    stopped = None
    try:
        server.wait_healthy()
        stopped = rank_pid(server.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        result: dict = {}

        def ask() -> None:
            result["response"] = post(server, "/v1/completions", {
                "model": model_dir.name, "prompt": "The garden", "max_tokens": 50,
                "ignore_eos": True})

        thread = threading.Thread(target=ask)
        thread.start()
        thread.join(timeout=90)
        elapsed = time.monotonic() - started
        assert not thread.is_alive(), "the request hung on a stopped peer"
        assert result["response"].status_code == 500, result["response"].text
        assert elapsed < 60, elapsed  # the heartbeat alone would take 120 s
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        server.stop()


def test_generation_config_directory_sets_the_sampling_defaults(tmp_path):
    """--generation-config DIR: a request without sampling fields samples as the file says
    (greedy with a repetition penalty, max_new_tokens as the cap), token for token the
    request that sets the same values itself; the file's penalty changes the greedy text."""
    model_dir = write_model(tmp_path / "model", "byte_level")
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(
        '{"temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 12}')
    server = launch("generation-config", model_dir, 1,
                    ["--capacity", "2", "--generation-config", str(defaults)], tmp_path)
    try:
        server.wait_healthy()
        base = {"model": model_dir.name, "prompt": "The garden", "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True}

        def tokens(**fields) -> list[str]:
            response = post(server, "/v1/completions", {**base, **fields})
            assert response.status_code == 200, response.text
            return strict_json(response.content)["choices"][0]["logprobs"]["tokens"]

        by_default = tokens(max_tokens=40)
        assert len(by_default) == 12
        assert by_default == tokens(max_tokens=12, temperature=0.0, repetition_penalty=1.8)
        assert by_default != tokens(max_tokens=12, temperature=0.0, repetition_penalty=1.0)
    finally:
        server.stop()
