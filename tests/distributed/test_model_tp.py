from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios_logprobs.collectives.groups import world_group
from helios_logprobs.ranks.model import ShardedCausalLM
from tests.distributed.harness import run_ranks
from tests.oracles import (
    TOLERANCE,
    build_checkpoint,
    expected_rows,
    reference_logits,
    run_schedule,
    schedule,
    sequence_tokens,
)

CHECKPOINTS = {"llama": ("llama", None), "qwen2": ("qwen2", None),
               "qwen3": ("qwen3", None), "mistral": ("mistral", None),
               "llama-llama3": ("llama", "llama3"), "qwen2-yarn": ("qwen2", "yarn")}
"""name -> (family, RoPE scaling)."""
TIMEOUT_S = 120.0

pytestmark = pytest.mark.slow


def rank_main(model_dirs: dict[str, str]) -> dict[str, dict]:
    """Runs on every rank of a gloo group (tests/distributed/harness.py)."""
    out = {}
    for name, model_dir in model_dirs.items():
        model = ShardedCausalLM.load(model_dir, world_group())
        logits = run_schedule(model, sequence_tokens(model.vocab_size))
        bounds = (model.vocab_start, model.local_width, model.local_valid)
        out[name] = {"bounds": bounds, "logits": logits}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("tp-models")
    out = {}
    for name, (family, rope) in CHECKPOINTS.items():
        model_dir = build_checkpoint(root / name, family, rope=rope)
        vocab = ShardedCausalLM.load(model_dir).vocab_size
        tokens = sequence_tokens(vocab)
        out[name] = (model_dir, tokens, reference_logits(model_dir, tokens))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_match_transformers_slices(world: int, checkpoints):
    per_rank = run_ranks(rank_main, world, {f: str(c[0]) for f, c in checkpoints.items()},
                         timeout_s=TIMEOUT_S)
    for name, (_, tokens, reference) in checkpoints.items():
        vocab = next(iter(reference.values())).shape[-1]
        width = -(-vocab // world)
        for rank in range(world):
            result = per_rank[rank][name]
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
