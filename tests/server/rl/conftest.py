"""Servers for the RL endpoints: checkpoints A and B (B: A's layout and tokenizer, other
weights), folders that must be refused, and servers on A and B at TP1 and TP2 (all started
at once; their start-ups overlap). Weight updates change a server's weights: these servers
are this package's own, never the session's shared ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.devices import missing_gpus
from tests.server.helpers import launch, write_model
from tests.server.rl.checkpoints import narrow_down_proj, rename_norm, reweighted

COMMON = ["--capacity", "4", "--batch-invariant"]
SERVERS = {"a1": ("a", 1), "b1": ("b", 1), "a2": ("a", 2), "b2": ("b", 2)}


@pytest.fixture(scope="session")
def rl_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rl-models")
    a = write_model(root / "a", "byte_level")
    return {"a": a, "b": reweighted(a, root / "b", seed=2),
            "renamed": reweighted(a, root / "renamed", seed=3, edit=rename_norm),
            "narrowed": reweighted(a, root / "narrowed", seed=4, edit=narrow_down_proj)}


@pytest.fixture(scope="session")
def rl_servers(rl_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-servers")
    started = {name: launch(f"rl_{name}", rl_models[model], tp, COMMON, root)
               for name, (model, tp) in SERVERS.items() if missing_gpus(tp) is None}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


def _ready(servers: dict, name: str):
    reason = missing_gpus(SERVERS[name][1])
    if reason is not None:
        pytest.skip(reason)
    servers[name].wait_healthy()
    return servers[name]


@pytest.fixture(scope="session")
def rl_a1(rl_servers):
    return _ready(rl_servers, "a1")


@pytest.fixture(scope="session")
def rl_b1(rl_servers):
    return _ready(rl_servers, "b1")


@pytest.fixture(scope="session")
def rl_a2(rl_servers):
    return _ready(rl_servers, "a2")


@pytest.fixture(scope="session")
def rl_b2(rl_servers):
    return _ready(rl_servers, "b2")
