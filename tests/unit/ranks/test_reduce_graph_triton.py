"""The reduce phase's region over the Triton backend (ranks/step/reduce_graph.py), under the
Triton interpreter: the six launches as the three ``helios::triton_*`` triton_ops
(kernels/triton/ops.py) with local workspaces. Dynamo traces the region whole (fullgraph; the
eager backend, since Inductor cannot run Triton kernels on CPU tensors: a GPU compiles it,
tests/gpu/test_cuda_graphs_gpu.py), with the launches in their order and no tensor attribute;
an engine whose reduce phase runs the traced region serves exactly what the eager Triton
engine serves, bit for bit, and the torch backend's tokens with logprobs within 2e-5 (its
whole-vocabulary lse and the interpreter's exp round apart by an ulp; SAME, 2e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import write_qwen2
from tests.serving_engines import explained_reduce_region, serving_engine
from tests.spec_helpers import assert_same_results, split_events
from tests.unit.ranks.test_capture_safe_step import LONG, SCORED, SERVING

pytestmark = [pytest.mark.triton_cpu, pytest.mark.slow]

TRITON_OPS = ["helios.triton_shard_stats", "helios.triton_shard_candidates",
              "helios.triton_final_merge"]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def engine_for(model_dir, backend: str):
    return serving_engine(model_dir, reduction_backend=backend)


def traced_region(step, calls: list, group: object = None) -> None:
    """The step's reduce phase through the region, traced by dynamo (eager backend)."""
    from helios_logprobs.ranks.step.reduce_graph import ReductionGraph

    graph = ReductionGraph(step.reduction, group, compile=False)
    traced = torch.compile(graph.region, backend="eager", fullgraph=True)

    def counting(*args):
        calls.append(1)
        return traced(*args)

    graph.fn = counting
    step.graph = graph


def served(events: list) -> list:
    """Every token, finish and logprob of a run, as exact values."""
    out = []
    for job in events:
        tokens, finish = split_events(job)
        out.append((finish, [(t.index, t.token_id, t.logprob,
                              [(p.token_id, p.logprob) for p in t.alternatives])
                             for t in tokens]))
    return out


def test_the_triton_region_is_one_graph_of_the_three_ops_with_local_workspaces(qwen2):
    from helios_logprobs.ranks.step.reduce_graph import ReductionGraph

    step = engine_for(qwen2, "triton").step
    explained, ops = explained_reduce_region(step)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert ops == TRITON_OPS
    graph = ReductionGraph(step.reduction, None, compile=False)
    assert [v for v in vars(graph).values() if isinstance(v, torch.Tensor)] == [graph.starts]


JOBS = [*SERVING[:4], SCORED, LONG]
"""Decode with and without logprobs, selected IDs, speculative rounds, a scored prompt and
chunked prefill (the interpreter runs every launch in Python: a shorter list than SERVING)."""


def test_an_engine_on_the_traced_triton_region_serves_the_eager_bits(qwen2):
    eager = served(engine_for(qwen2, "triton").run_offline(JOBS))
    engine, calls = engine_for(qwen2, "triton"), []
    traced_region(engine.step, calls)
    events = engine.run_offline(JOBS)
    assert served(events) == eager
    assert len(calls) > 10
    assert_same_results(events, engine_for(qwen2, "torch").run_offline(JOBS))
