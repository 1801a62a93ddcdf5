"""vLLM's pause modes on a running server: "abort" ends the requests in flight with finish
reason "abort", "wait" returns once they have finished, "keep" freezes them until the resume
(then they finish as if never paused); requests sent while paused wait for the resume."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.helpers import post, strict_json

pytestmark = pytest.mark.slow

PROMPT = [5, 77, 130, 42, 9]


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


class Streaming(threading.Thread):
    """A streamed completion read chunk by chunk in the background."""

    def __init__(self, server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.chunks: list[dict] = []
        self.first = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.server.url + "/v1/completions",
                          json=body(self.max_tokens, stream=True), timeout=120.0) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(strict_json(line[len("data: "):]))
                    self.first.set()

    def ids(self) -> list[int]:
        return [t for c in self.chunks for choice in c["choices"]
                for t in choice.get("token_ids") or []]

    def finish(self) -> str | None:
        reasons = [ch["finish_reason"] for c in self.chunks for ch in c["choices"]
                   if ch["finish_reason"] is not None]
        return reasons[-1] if reasons else None


def call(server, path: str, **query) -> httpx.Response:
    return httpx.post(server.url + path, params=query, timeout=120.0)


def test_abort_ends_requests_in_flight_and_new_ones_wait_for_the_resume(rl_a1):
    stream = Streaming(rl_a1, 200)
    stream.start()
    assert stream.first.wait(60)
    assert call(rl_a1, "/pause", mode="abort").json() == {"status": "paused"}
    stream.join(60)
    assert stream.finish() == "abort" and len(stream.ids()) < 200
    late: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: late.append(post(rl_a1, "/v1/completions",
                                                               body(6))))
    waiting.start()
    time.sleep(1.5)
    assert not late  # held while paused
    assert call(rl_a1, "/resume").json() == {"status": "resumed"}
    waiting.join(60)
    choice = strict_json(late[0].content)["choices"][0]
    reference = strict_json(post(rl_a1, "/v1/completions", body(6)).content)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == reference["token_ids"]


def test_wait_returns_after_the_requests_in_flight_finish(rl_a1):
    stream = Streaming(rl_a1, 60)
    stream.start()
    assert stream.first.wait(60)
    assert call(rl_a1, "/pause", mode="wait").json() == {"status": "paused"}
    try:
        stream.join(10)
        assert not stream.is_alive()
        assert stream.finish() == "length" and len(stream.ids()) == 60
    finally:
        call(rl_a1, "/resume")


def test_keep_freezes_requests_until_the_resume(rl_a1):
    reference = strict_json(post(rl_a1, "/v1/completions", body(80)).content)["choices"][0]
    stream = Streaming(rl_a1, 80)
    stream.start()
    assert stream.first.wait(60)
    assert call(rl_a1, "/pause", mode="keep").json() == {"status": "paused"}
    try:
        time.sleep(0.5)
        frozen = len(stream.ids())
        time.sleep(1.5)
        assert len(stream.ids()) == frozen < 80 and stream.is_alive()
    finally:
        assert call(rl_a1, "/resume").status_code == 200
    stream.join(60)
    assert stream.finish() == "length" and stream.ids() == reference["token_ids"]


def test_pause_refusals(rl_a1):
    response = call(rl_a1, "/pause", mode="later")
    assert response.status_code == 400
    assert strict_json(response.content)["error"]["param"] == "mode"
    response = post(rl_a1, "/update_weights", {"update_info": {}})
    assert response.status_code == 400
    assert strict_json(response.content)["error"]["param"] == "update_info.model_path"
    assert not httpx.get(rl_a1.url + "/is_paused", timeout=30).json()["is_paused"]
