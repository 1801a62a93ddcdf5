"""The capacity report against real ranks at TP2 and TP4 (gloo): on every rank, each buffer
the report lists equals the tensors at its path, byte for byte, and the tensors reachable
from the RankStep are exactly those (tests/unit/ranks/test_capacity.py has the checks). The
vocabulary 301 leaves padding lanes on the last rank; TP4 replicates the two KV heads."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_llama, write_qwen2
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

CASES = {
    "k20": dict(),
    "prompt-logprobs": dict(prompt_logprobs=True, chunk_size=600),
    "k5-t3": dict(max_logprobs=5, completion_token_capacity=3),
    "logprobs-off": dict(logprobs=False),
    "triton": dict(reduction_backend="triton"),
    "speculative": dict(speculative_tokens=2, completion_token_capacity=4),
}


def rank_main(model_dirs: dict[str, str]) -> list[tuple]:
    from helios_logprobs.collectives.groups import group_rank, group_size, world_group
    from helios_logprobs.ranks.capacity.sizing import rank_sizing
    from helios_logprobs.runtime.engine.bootstrap import build_engine
    from tests.capacity_checks import build, check_host, check_kv_allocator, check_rank

    group = world_group()
    world, rank = group_size(group), group_rank(group)
    seen = []
    for name, model_dir in model_dirs.items():
        for case, overrides in CASES.items():
            config, step = build(model_dir, group=group, **overrides)
            sizing = rank_sizing(step.model.config, step.config, world, rank,
                                 step.model.dtype, interpreted=True)
            assert sizing.layout == step.model.layout
            check_rank(step, sizing)
            if rank == 0:
                check_host(build_engine(config, step), step, sizing)
            else:
                assert not sizing.host
            check_kv_allocator(step.model, sizing, 2, 5)
            layout = sizing.layout
            # (the sampler's bool plan pool holds a row of the shard's valid lanes, the one
            # buffer sized by local_valid rather than the padded width)
            lanes = sum(b.nbytes for b in sizing.buffers
                        if b.path == "sampler.buffers.bool.values")
            assert lanes == step.config.max_rows * (layout.local_valid + 2)
            seen.append((name, case, layout.vocab_start, layout.local_valid,
                         layout.local_kv_heads, sizing.device_bytes - lanes))
    return seen


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {
        "qwen2": str(write_qwen2(tmp_path_factory.mktemp("qwen2"))),  # vocab 301, tied
        "llama": str(write_llama(tmp_path_factory.mktemp("llama"))),  # vocab 300, untied
    }


@pytest.mark.parametrize("world", [2, 4])
def test_report_equals_every_rank(world, checkpoints):
    results = run_ranks(rank_main, world, checkpoints, timeout_s=240)
    last = results[-1]
    qwen_k20 = next(r for r in last if r[:2] == ("qwen2", "k20"))
    width = -(-301 // world)
    assert qwen_k20[2:5] == ((world - 1) * width, 301 - (world - 1) * width, 1)
    # Every rank holds the same bytes besides the bool plan pool: shapes use the padded width.
    for case in zip(*results, strict=True):
        assert len({r[5] for r in case}) == 1, case
