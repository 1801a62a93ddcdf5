"""The engine the step-level serving tests share (capture-safe, compiled, Triton region): the
random Qwen2 checkpoint behind an engine with room for every kind of work (four slots, chunked
prefill, speculative rounds, prompt scoring), and dynamo's account of its reduce region."""

from __future__ import annotations

import torch

SCALAR_INDUCTOR = {"cpp.simdlen": 0}
"""The in-process compile tests' Inductor setting (``torch._inductor.config.patch``): scalar
C++ kernels, a quarter less cold compile on the 2-core CI machine. What they check (graph
counts, no break or recompilation, tokens and logprobs against eager) does not depend on the
vector width; the default, vectorized code is what tests/server/lifecycle/test_compiled_server.py
serves."""

SERVING_CONFIG = dict(capacity=4, max_model_len=96, chunk_size=8, speculative_tokens=2,
                      ngram_min=1, ngram_max=3, prompt_logprobs=True)


def serving_engine(model_dir, group: object = None, **fields):
    """An engine over ``model_dir`` with SERVING_CONFIG and ``fields`` (compile, backend...)
    on this process's rank of ``group`` (None: one rank)."""
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    config = RuntimeConfig(model_dir=model_dir, **SERVING_CONFIG, **fields)
    return build_engine(config, load_rank(config, group))


def explained_reduce_region(step, group: object = None):
    """(dynamo's explanation of the step's reduce region, uncompiled, over the step's own
    buffers; the region's ``helios`` ops in graph order)."""
    from helios_logprobs.ranks.step.reduce_graph import ReductionGraph

    graph = ReductionGraph(step.reduction, group, compile=False)
    r, o = step.reduction, step.outputs
    explained = torch._dynamo.explain(graph.region)(
        step.buffers.row_tensors, step.buffers.frame_index, r.logits, o.completion_records,
        o.logprob_requested, o.logprob_token_ids, o.logprob_token_id_counts,
        o.completion_logprobs)
    ops = [str(n.target) for fx in explained.graphs for n in fx.graph.nodes
           if n.op == "call_function" and "helios" in str(n.target)]
    return explained, ops
