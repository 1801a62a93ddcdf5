"""--compile at TP2 over gloo (issue 36): on every rank the step runs nine
torch.compile(fullgraph=True) graphs, all compiled at start-up. The forward's graphs (one token;
padded token buckets) sum its row-parallel outputs through ``helios::all_reduce_sum`` (the
embedding, then attention and MLP per layer); the sample phase's five (one row, sampled or
greedy; buckets 2, 4, 8, 12 dynamic, filtered, sampled or greedy) run the capture-safe sampler's
launches and its twelve exchanges (row maxima, two five-round radix selects, the pick) as custom
ops; prompt scoring's block (projection, launches, two exchanges) one; the reduce phase's
launches and both exchanges are custom ops (helios::shard_stats, word_exchange,
shard_candidates, word_exchange, final_merge, in that order). A mixed serving run (decode at
several batch sizes, chunked and scored prefill, selected IDs, logprobs on and off, speculative
rounds) compiles nothing more, runs every submission through the compiled forward, and serves
the eager run's tokens with logprobs within 2e-5, the same on both ranks."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_qwen2
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow


def rank_main(model_dir: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from helios_logprobs.collectives.groups import world_group
    from tests.serving_engines import (
        SCALAR_INDUCTOR,
        explained_reduce_region,
        serving_engine,
    )
    from tests.unit.ranks.test_capture_safe_step import SERVING

    out = {}
    for compile in (True, False):
        with torch._inductor.config.patch(SCALAR_INDUCTOR):
            engine = serving_engine(model_dir, world_group(), compile=compile)
        if compile:
            sampler = engine.step.sampler  # (the capture-safe one, for the sample graph)
        before = counters["stats"]["unique_graphs"]
        buckets = []
        if compile:
            graph = engine.step.forward_graph
            select = graph.select

            def selecting(host, select=select, buckets=buckets):
                variant = select(host)
                buckets.append(None if variant is None else variant.tokens)
                return variant

            graph.select = selecting
        with torch._dynamo.config.patch(error_on_recompile=True):
            out[compile] = engine.run_offline(SERVING)
        out[f"graphs {compile}"] = (before, counters["stats"]["unique_graphs"])
        out[f"buckets {compile}"] = buckets
    out["breaks"] = sum(counters["graph_break"].values())
    step = engine.step
    explained, out["ops"] = explained_reduce_region(step, world_group())
    out["explained"] = (explained.graph_count, explained.graph_break_count)
    model = step.model
    model.allocate_cache(4, 96, spare_slots=1)  # (the eager step's cache has no spare slot)
    tokens = torch.tensor([5, 6, 7, 4], dtype=torch.int64)
    explained = torch._dynamo.explain(model.forward_tokens)(
        tokens, torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 4]), torch.arange(3))
    (fx,) = explained.graphs
    out["forward ops"] = [str(n.target) for n in fx.graph.nodes
                          if n.op == "call_function" and "helios" in str(n.target)]
    out["forward explained"] = (explained.graph_count, explained.graph_break_count)
    out["layers"] = len(model.weights.layers)
    from helios_logprobs.ranks.step.sample_graph import SampleGraph

    sampled = SampleGraph(sampler, world_group(), compile=False)
    explained = torch._dynamo.explain(sampled.region)(*sampled.arguments(4))
    (fx,) = explained.graphs
    out["sample ops"] = [str(n.target) for n in fx.graph.nodes
                         if n.op == "call_function" and "helios" in str(n.target)]
    out["sample explained"] = (explained.graph_count, explained.graph_break_count)
    return out


@pytest.mark.timeout(900)  # (two ranks compile nine graphs each on a loaded 2-core machine)
def test_tp2_compiled_step_compiles_at_start_up_only_and_serves_the_eager_results(tmp_path):
    from tests.spec_helpers import assert_same_results

    model_dir = write_qwen2(tmp_path / "qwen2")
    ranks = run_ranks(rank_main, 2, str(model_dir), timeout_s=900)
    for rank in ranks:
        assert rank["graphs True"] == (9, 9)  # compiled at start-up, nothing while serving
        assert rank["graphs False"] == (9, 9)
        assert rank["breaks"] == 0
        assert rank["explained"] == (1, 0)
        assert rank["ops"] == ["helios.shard_stats.default", "helios.word_exchange.default",
                               "helios.shard_candidates.default",
                               "helios.word_exchange.default", "helios.final_merge.default"]
        assert rank["forward explained"] == (1, 0)
        assert rank["forward ops"] == ["helios.all_reduce_sum.default"] * (
            1 + 2 * rank["layers"])
        assert rank["sample explained"] == (1, 0)
        exchange = "helios.word_exchange.default"
        assert rank["sample ops"] == ["helios.sample_scale.default", *[exchange] * 11,
                                      "helios.sample_best.default", exchange,
                                      "helios.sample_pick.default"]
        sizes = rank["buckets True"]
        assert None not in sizes and len(set(sizes)) >= 3, sizes  # several decode buckets
        assert rank["buckets False"] == []
        assert_same_results(rank[True], rank[False])
        assert rank[True] == ranks[0][True]
