"""The server helper itself: a port that another process bound first is not mistaken for the
server's (its /health may answer 200), and the server starts again on a fresh port."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.server import helpers

pytestmark = pytest.mark.slow


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_taken_port_is_not_mistaken_and_the_server_moves(tmp_path, monkeypatch, model_dirs):
    impostor = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    taken = impostor.server_address[1]
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    ports = iter([taken])
    fresh = helpers.free_port
    monkeypatch.setattr(helpers, "free_port", lambda: next(ports, None) or fresh())
    server = helpers.launch("clash", model_dirs["byte_level"], 1, ["--capacity", "2"], tmp_path)
    try:
        assert server.port == taken
        assert httpx.get(server.url + "/health").status_code == 200  # the impostor answers
        server.wait_healthy()
        assert server.launches == 2 and server.port != taken
        assert server.client().models.list().data[0].id == "byte_level"
    finally:
        server.stop()
        impostor.shutdown()
        impostor.server_close()

