"""Servers for the RL endpoints: checkpoints A and B (B: A's layout and tokenizer, other
weights), folders that must be refused, and servers on A and B at TP1 and TP2 (each started
on first use; a module that needs several starts them together). Weight updates change a
server's weights: these servers are this package's own, never the session's shared ones."""

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


class RLServers:
    """This package's servers, each started on first use (``start`` begins several at once,
    so their start-ups overlap) and stopped at the end of the session."""

    def __init__(self, models: dict[str, Path], log_dir: Path) -> None:
        self.models, self.log_dir = models, log_dir
        self.started: dict = {}

    def start(self, *names: str) -> None:
        for name in names:
            model, tp = SERVERS[name]
            if name not in self.started and missing_gpus(tp) is None:
                self.started[name] = launch(f"rl_{name}", self.models[model], tp, COMMON,
                                            self.log_dir)

    def get(self, name: str):
        reason = missing_gpus(SERVERS[name][1])
        if reason is not None:
            pytest.skip(reason)
        self.start(name)
        self.started[name].wait_healthy()
        return self.started[name]

    def stop(self) -> None:
        for server in self.started.values():
            server.stop()


@pytest.fixture(scope="session")
def rl_servers(rl_models, tmp_path_factory):
    servers = RLServers(rl_models, tmp_path_factory.mktemp("rl-servers"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def rl_a1(rl_servers):
    return rl_servers.get("a1")


@pytest.fixture(scope="session")
def rl_b1(rl_servers):
    return rl_servers.get("b1")


@pytest.fixture(scope="session")
def rl_a2(rl_servers):
    return rl_servers.get("a2")


@pytest.fixture(scope="session")
def rl_b2(rl_servers):
    return rl_servers.get("b2")
