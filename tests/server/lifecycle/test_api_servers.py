"""The engine core and its API server processes (--api-server-count), under real failures.

- An API server SIGKILLed with streams in flight: its streams break, the engine core aborts
  exactly those requests (its log line counts them, its running gauge drops), the streams on
  the other API server run to their end with the same tokens as an undisturbed request, and
  the server keeps answering.
- The engine core SIGKILLed mid-stream: every API server ends its streams with an error
  event and [DONE], and exits within seconds.
(The queue bounds are in tests/server/protocol/test_frontend_queues.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.helpers import descendants, launch, strict_json, write_model

pytestmark = pytest.mark.slow

STREAM = {"prompt": [5, 6, 9], "temperature": 0.0, "ignore_eos": True, "logprobs": 2,
          "stream": True, "return_tokens_as_token_ids": True}
LONG = 500


def api_servers(core_pid: int) -> list[int]:
    """The API server processes below the engine core (HELIOS_API_SERVER in their env)."""
    found = []
    for pid in descendants(core_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as env:
                if b"HELIOS_API_SERVER=" in env.read():
                    found.append(pid)
        except OSError:
            continue
    return sorted(found)


def connection_owner(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the accepted TCP connection from ``client_port``."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                if local == server_port and remote == client_port:
                    inode = f"socket:[{fields[9]}]"
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == inode:
                    return pid
        except OSError:
            continue
    return None


def gauge(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith(f"helios:{name} "))
    return float(line.split()[1])


class Stream(threading.Thread):
    """One streaming completion read line by line; ``client_port`` once connected."""

    def __init__(self, server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.body = {**STREAM, "model": server.model_dir.name, "max_tokens": max_tokens}
        self.lines: list[str] = []
        self.client_port: int | None = None
        self.started_event = threading.Event()
        self.broken = False

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body,
                              timeout=120) as response:
                stream = response.extensions["network_stream"]
                self.client_port = stream.get_extra_info("client_addr")[1]
                for line in response.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: {"):
                        self.started_event.set()
        except httpx.HTTPError:
            self.broken = True
        self.started_event.set()

    def events(self) -> list[dict]:
        return [strict_json(line[6:]) for line in self.lines if line.startswith("data: {")]

    def last_line(self) -> str | None:
        lines = [line for line in self.lines if line]
        return lines[-1] if lines else None

    def tokens(self) -> list[str]:
        return [t for e in self.events() for c in e.get("choices", ())
                for t in (c.get("logprobs") or {}).get("tokens", [])]


@pytest.fixture
def model_dir(tmp_path):
    return write_model(tmp_path / "model", "byte_level")


def test_an_api_server_killed_mid_stream(model_dir, tmp_path):
    # The tiny model's whole context (512), so no stream can end before the last one starts.
    server = launch("asc2", model_dir, 1, ["--capacity", "16", "--api-server-count", "2",
                                           "--max-model-len", "512"], tmp_path)
    try:
        server.wait_healthy()
        pids = api_servers(server.pid)
        assert len(pids) == 2, pids
        reference = Stream(server, LONG)
        reference.run()
        # Streams, four at a time and all connected before any is waited on, until each API
        # server holds at least one (whichever process is awake accepts a connection).
        streams: list[Stream] = []
        owners: dict[int, list[Stream]] = {pid: [] for pid in pids}
        while not all(owners.values()) and len(streams) < 12:
            batch = [Stream(server, LONG) for _ in range(4)]
            for stream in batch:
                stream.start()
            for stream in batch:
                assert stream.started_event.wait(60)
                streams.append(stream)
                owners[connection_owner(server.port, stream.client_port, pids)].append(stream)
        assert all(stream.is_alive() for stream in streams), "a stream ended before the kill"
        assert all(owners.values()), "every stream went to one API server"
        # /metrics, asked of either API server: the engine core's gauges, and the servers'
        # own counts added up over both (each holds some of the streams).
        assert gauge(server, "num_requests_admitted") == len(streams)
        assert gauge(server, "num_requests_running") == len(streams)
        assert 0 < gauge(server, "kv_cache_usage_perc") < 1
        victim, survivor = pids
        os.kill(victim, signal.SIGKILL)
        for stream in streams:
            stream.join(timeout=120)
            assert not stream.is_alive()
        for stream in owners[victim]:
            assert stream.last_line() != "data: [DONE]"  # cut off
        for stream in owners[survivor]:  # undisturbed: the whole, same greedy stream
            assert stream.last_line() == "data: [DONE]"
            assert stream.tokens() == reference.tokens()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and f"{len(owners[victim])} request(s) aborted" \
                not in server.log_tail():
            time.sleep(0.2)
        assert f"{len(owners[victim])} request(s) aborted" in server.log_tail()
        assert gauge(server, "num_requests_running") == 0
        again = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={**STREAM, "stream": False, "model": model_dir.name,
                                 "max_tokens": LONG})
        assert again.status_code == 200
        assert again.json()["choices"][0]["logprobs"]["tokens"] == reference.tokens()
        assert server.running() and api_servers(server.pid) == [survivor]
        # Latency histograms: one first token per request, one end per finished request (the
        # victim's requests never ended); its counts stay, its admitted gauge goes.
        assert gauge(server, "time_to_first_token_seconds_count") == len(streams) + 2
        assert gauge(server, "e2e_request_latency_seconds_count") == \
            len(owners[survivor]) + 2
        assert gauge(server, "num_requests_admitted") == 0
    finally:
        server.stop()


def test_the_engine_core_killed(model_dir, tmp_path):
    server = launch("core-killed", model_dir, 1,
                    ["--capacity", "4", "--api-server-count", "2"], tmp_path)
    try:
        server.wait_healthy()
        pids = api_servers(server.pid)
        assert len(pids) == 2
        streams = [Stream(server, 200) for _ in range(3)]
        for stream in streams:
            stream.start()
            assert stream.started_event.wait(60)
        os.kill(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            stream.join(timeout=30)
            assert not stream.is_alive(), "a stream outlived the engine core"
            events = stream.events()
            assert events[-1]["error"]["code"] == 500, events[-1]
            assert "engine core is gone" in events[-1]["error"]["message"]
            assert stream.last_line() == "data: [DONE]"
            assert len(stream.tokens()) < 200
        while any(os.path.exists(f"/proc/{pid}") and _not_zombie(pid) for pid in pids):
            assert time.monotonic() - killed < 15, "an API server outlived the engine core"
            time.sleep(0.1)
    finally:
        for pid in api_servers(server.pid):
            os.kill(pid, signal.SIGKILL)
        server.stop()


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
