"""The reduce phase's region over the Triton backend at TP2 over gloo, under the Triton
interpreter (ranks/step/reduce_graph.py; TP1: tests/unit/ranks/test_reduce_graph_triton.py):
dynamo traces it whole with the two exchanges between the three triton_ops (shard stats,
word_exchange, candidates, word_exchange, final merge), and an engine on the traced region
(the eager backend: Inductor runs Triton kernels on GPU tensors only) serves exactly the eager
Triton engine's tokens and logprobs, the same on both ranks."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_qwen2
from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.triton_cpu]


def rank_main(model_dir: str) -> dict:
    from helios_logprobs.collectives.groups import world_group
    from tests.serving_engines import explained_reduce_region, serving_engine
    from tests.unit.ranks.test_capture_safe_step import SCORED, SERVING
    from tests.unit.ranks.test_reduce_graph_triton import served, traced_region

    jobs = [*SERVING[:4], SCORED]
    group = world_group()
    out = {"eager": served(serving_engine(model_dir, group, reduction_backend="triton")
                           .run_offline(jobs))}
    engine, calls = serving_engine(model_dir, group, reduction_backend="triton"), []
    traced_region(engine.step, calls, group)
    out["traced"], out["calls"] = served(engine.run_offline(jobs)), len(calls)
    explained, out["ops"] = explained_reduce_region(engine.step, group)
    out["explained"] = (explained.graph_count, explained.graph_break_count)
    return out


def test_tp2_triton_region_traces_whole_and_serves_the_eager_bits(tmp_path):
    model_dir = write_qwen2(tmp_path / "qwen2")
    ranks = run_ranks(rank_main, 2, str(model_dir), timeout_s=600)
    for rank in ranks:
        assert rank["explained"] == (1, 0)
        exchange = "helios.word_exchange.default"
        assert rank["ops"] == ["helios.triton_shard_stats", exchange,
                               "helios.triton_shard_candidates", exchange,
                               "helios.triton_final_merge"]
        assert rank["calls"] > 5
        assert rank["traced"] == rank["eager"] == ranks[0]["eager"]
