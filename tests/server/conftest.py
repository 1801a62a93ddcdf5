"""Real server subprocesses on loopback, driven by the official `openai` client.

Servers are session-scoped; every server that the collected tests need starts at once (so their
start-up overlaps) and is always terminated at the end of the session. The helpers live in
tests/server/helpers.py; this file holds only fixtures and hooks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.devices import missing_gpus
from tests.server.helpers import SERVERS, Server, build_models, launch, locked


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def _servers(request, tmp_path_factory):
    """Start every server the collected tests need, at once. Under pytest-xdist the workers
    share them: the first worker starts them, the last one to finish stops them."""
    wanted = getattr(request.config, "_helios_servers", set(SERVERS))
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    shared = shared / "helios-servers"
    shared.mkdir(exist_ok=True)
    state_path = shared / "state.json"
    mine: dict[str, Server] = {}
    with locked(shared / "lock"):
        state = json.loads(state_path.read_text()) if state_path.exists() else {
            "users": 0, "servers": {}}
        models = shared / "models"
        if not (models / "byte_fallback" / "tokenizer_config.json").exists():
            build_models(models)
        for name in sorted(wanted - set(state["servers"])):
            kind, tp, extra = SERVERS[name]
            if missing_gpus(tp) is not None:
                continue  # its fixture skips (tests/devices.py)
            mine[name] = launch(name, models / kind, tp, extra, shared, home=shared)
            state["servers"][name] = mine[name].state()
        state["users"] += 1
        state_path.write_text(json.dumps(state))
    servers = {name: mine.get(name) or Server.from_state(name, info)
               for name, info in state["servers"].items()}
    try:
        yield servers
    finally:
        with locked(shared / "lock"):
            state = json.loads(state_path.read_text())
            state["users"] -= 1
            if state["users"] == 0:
                for name, info in state["servers"].items():
                    (mine.get(name) or Server.from_state(name, info)).stop()
                state["servers"] = {}
            state_path.write_text(json.dumps(state))


def pytest_collection_modifyitems(config, items):
    config._helios_servers = {n for item in items for n in getattr(item, "fixturenames", ())
                              if n in SERVERS}


def _ready(servers: dict[str, Server], name: str) -> Server:
    reason = missing_gpus(SERVERS[name][1])
    if reason is not None:
        pytest.skip(reason)
    server = servers[name]
    server.wait_healthy()
    return server


@pytest.fixture(scope="session")
def server(_servers) -> Server:
    return _ready(_servers, "server")


@pytest.fixture(scope="session")
def plain_server(_servers) -> Server:
    return _ready(_servers, "plain_server")


@pytest.fixture(scope="session")
def tp4_server(_servers) -> Server:
    return _ready(_servers, "tp4_server")


@pytest.fixture(scope="session")
def scoring_server(_servers) -> Server:
    return _ready(_servers, "scoring_server")
