"""A streaming client that connects and never reads, through a real server (the engine core and
its API server process: the default, --api-server-count 1).

The slow stream asks for 32 choices of nearly the whole context at logprobs=20 (~11 MB of
SSE). Its socket's small receive buffer fills, then the server's kernel buffer (~3 MB on
loopback) and uvicorn's; the HTTP server stops writing (flow control), each choice's bound in
the API server (64 events at T=1) fills and its requests are aborted in the engine core: the
core copies far fewer frames than the choices asked tokens, and neither the core's nor the
API server's memory grows with the output they were asked for. Meanwhile other clients are
served and get the same greedy tokens as an undisturbed request. Read at last, the slow
stream holds what was sent before the bound and ends with the "client too slow" error event.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.helpers import launch, write_model
from tests.server.lifecycle.test_api_servers import api_servers, gauge

pytestmark = pytest.mark.slow

CONTEXT = 512
SLOW_TOKENS = 480
CHOICES = 32
OTHERS = 6
OTHER = {"prompt": [7, 8, 9, 10], "temperature": 0.0, "ignore_eos": True, "logprobs": 5,
         "max_tokens": 48, "return_tokens_as_token_ids": True}
MB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def counter(server, name: str) -> float:
    return gauge(server, f"{name}_total")


def stream_tokens(lines: list[str]) -> list[str]:
    return [t for line in lines if line.startswith("{") for c in json.loads(line)["choices"]
            for t in c["logprobs"]["tokens"]]


class SlowClient:
    """A raw HTTP/1.1 streaming request whose response is not read until ``read_all``."""

    def __init__(self, port: int, body: dict) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect)
        self.sock.connect(("127.0.0.1", port))
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(data) + data)

    def read_all(self, timeout_s: float = 60) -> list[str]:
        """The SSE data lines of the whole (chunked) response."""
        self.sock.settimeout(timeout_s)
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):
            block = self.sock.recv(1 << 16)
            if not block:
                break
            raw += block
        self.sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        assert b"transfer-encoding: chunked" in head.lower()
        text = b""
        while body:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line, 16)
            text, body = text + body[:size], body[size + 2:]
            if size == 0:
                break
        return [line[6:] for line in text.decode().split("\n") if line.startswith("data: ")]


@pytest.fixture
def model_dir(tmp_path):
    return write_model(tmp_path / "model", "byte_level")


def test_a_client_that_never_reads(model_dir, tmp_path):
    server = launch("slow", model_dir, 1, ["--capacity", "40", "--max-model-len", str(CONTEXT),
                                           "--completion-token-capacity", "1"], tmp_path)
    try:
        server.wait_healthy()
        (api_server,) = api_servers(server.pid)
        other = {**OTHER, "model": model_dir.name}
        reference = httpx.post(server.url + "/v1/completions", json=other, timeout=60).json()
        want = reference["choices"][0]["logprobs"]["tokens"]
        assert len(want) == OTHER["max_tokens"]
        # Warm both processes with a whole stream of the slow kind, read at once, at the batch
        # the test runs (a larger batch than ever before grows the step's working memory).
        slow_body = {"model": model_dir.name, "prompt": [5, 6, 9], "temperature": 1.0,
                     "seed": 7, "ignore_eos": True, "logprobs": 20, "max_tokens": SLOW_TOKENS,
                     "stream": True, "return_tokens_as_token_ids": True}
        warm_choices = CHOICES + OTHERS
        warm = httpx.post(server.url + "/v1/completions", json={**slow_body, "n": warm_choices},
                          timeout=600)
        assert warm.text.count('"finish_reason":"length"') == warm_choices
        per_token = len(warm.content) / (warm_choices * SLOW_TOKENS)
        assert per_token > 500  # bytes of SSE per token and choice
        core_before, api_before = rss(server.pid), rss(api_server)
        frames_before = counter(server, "frames_copied")

        slow = SlowClient(server.port, {**slow_body, "n": CHOICES})
        results: list[list[str]] = []

        def serve_one() -> None:
            answer = httpx.post(server.url + "/v1/completions", json=other, timeout=120)
            results.append(answer.json()["choices"][0]["logprobs"]["tokens"])

        others = [threading.Thread(target=serve_one) for _ in range(OTHERS)]
        for thread in others:
            thread.start()
        for thread in others:
            thread.join(timeout=120)
        assert results == [want] * OTHERS  # served, and the same greedy tokens

        # The slow requests leave the engine core while their sockets are still unread.
        deadline = time.monotonic() + 60
        while gauge(server, "num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gauge(server, "num_requests_running") == 0
        time.sleep(1.0)  # (nothing runs now: the counters below stay put)
        frames = counter(server, "frames_copied") - frames_before
        # Each step copies one frame for every request that sampled in it; run to their end,
        # the slow requests alone would have taken SLOW_TOKENS steps.
        assert frames < SLOW_TOKENS * 0.6, frames
        core_growth, api_growth = rss(server.pid) - core_before, rss(api_server) - api_before
        asked = per_token * CHOICES * SLOW_TOKENS  # (~11 MB)
        print(f"frames {frames}, RSS growth core {core_growth / MB:.1f} MB, API server "
              f"{api_growth / MB:.1f} MB, asked {asked / MB:.1f} MB")
        # The core keeps nothing of a step once sent. RSS moves by a few MB under a loaded
        # machine (allocator arenas, new step shapes), so this bound catches the core holding
        # the output as formatted bytes or per-token objects (each several times `asked`), not
        # as bare arrays (~2.8 MB): the packer's emptiness after every flush is
        # tests/server/protocol/test_frontend_queues.py's. The API server: at most 64 events
        # per choice.
        assert core_growth < asked / 3, core_growth
        assert api_growth < asked / 2, api_growth
        assert server.running()

        lines = slow.read_all()
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert "client too slow" in error["message"], error
        tokens = stream_tokens(lines[:-2])
        assert 0 < len(tokens) < CHOICES * SLOW_TOKENS * 0.6
        assert len(lines[:-2]) * per_token * 0.5 < asked
    finally:
        server.stop()
