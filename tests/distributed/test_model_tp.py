from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from collectives.groups import destroy, init_from_env, world_group
from ranks.model import ShardedCausalLM
from tests.oracles import (
    TOLERANCE,
    build_checkpoint,
    expected_rows,
    reference_logits,
    run_schedule,
    schedule,
    sequence_tokens,
)

FAMILIES = ("llama", "qwen2")
TIMEOUT_S = 120.0

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, model_dirs: dict[str, str], out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    init_from_env(timeout_s=60.0, backend="gloo")
    try:
        for family, model_dir in model_dirs.items():
            model = ShardedCausalLM.load(model_dir, world_group())
            logits = run_schedule(model, sequence_tokens(model.vocab_size))
            bounds = (model.vocab_start, model.local_width, model.local_valid)
            torch.save({"bounds": bounds, "logits": logits}, Path(out_dir) / f"{family}-{rank}.pt")
    finally:
        destroy()


def spawn(world: int, model_dirs: dict[str, str], out_dir: Path) -> None:
    context = mp.start_processes(
        _worker,
        args=(world, free_port(), model_dirs, str(out_dir)),
        nprocs=world,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"TP{world} workers did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("tp-models")
    out = {}
    for family in FAMILIES:
        model_dir = build_checkpoint(root / family, family)
        vocab = ShardedCausalLM.load(model_dir).vocab_size
        tokens = sequence_tokens(vocab)
        out[family] = (model_dir, tokens, reference_logits(model_dir, tokens))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_match_transformers_slices(world: int, checkpoints, tmp_path: Path):
    spawn(world, {f: str(c[0]) for f, c in checkpoints.items()}, tmp_path)
    for family, (_, tokens, reference) in checkpoints.items():
        vocab = next(iter(reference.values())).shape[-1]
        width = -(-vocab // world)
        for rank in range(world):
            result = torch.load(tmp_path / f"{family}-{rank}.pt")
            start, local_width, valid = result["bounds"]
            assert (start, local_width) == (rank * width, width)
            assert valid == min(width, vocab - start)
            steps = schedule(tokens)
            for step, logits in zip(steps, result["logits"], strict=True):
                assert logits.shape == (len(step.expected), width)
                expected = expected_rows(step, reference)[:, start : start + valid]
                torch.testing.assert_close(
                    logits[:, :valid], expected, atol=TOLERANCE, rtol=TOLERANCE
                )
