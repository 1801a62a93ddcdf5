"""--compile at TP1 on CPU (issue 36): the step runs torch.compile(fullgraph=True) graphs compiled
at start-up, the forward's two (one token; padded token buckets: ranks/step/forward_graph.py),
the sample phase's five (one row, sampled or greedy; the padded row buckets, dynamic, filtered,
sampled or greedy: ranks/step/sample_graph.py), prompt scoring's padded block
(ranks/step/scoring.py), and the reduce phase's (gate, launches as custom ops, payload write:
ranks/step/reduce_graph.py). A serving run that mixes decode at several batch sizes, chunked
prefill, scored prefill, selected IDs, logprobs on and off and speculative rounds runs every
submission through them, compiles nothing more (dynamo's counters, and error_on_recompile) and
serves the eager engine's tokens with logprobs within 2e-5 (Inductor's fused norms and padded
attention round differently from the eager forward). The TP2 run is
tests/distributed/test_compiled_reduction_tp.py; the forward's padding and buckets are
tests/unit/ranks/test_compiled_forward.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from tests.checkpoints import write_qwen2
from tests.serving_engines import SCALAR_INDUCTOR, explained_reduce_region, serving_engine
from tests.spec_helpers import assert_same_results
from tests.unit.ranks.test_capture_safe_step import SERVING, PlanLog

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def engine_for(model_dir, compile: bool):
    return serving_engine(model_dir, compile=compile)


def graph_counts() -> dict:
    from helios_logprobs.ranks.step.reduce_graph import compile_counters

    counted = compile_counters()
    assert counted == {"graphs": counters["stats"]["unique_graphs"],
                       "graph_breaks": sum(counters["graph_break"].values())}
    return {"graphs": counted["graphs"], "breaks": counted["graph_breaks"]}


@pytest.fixture(scope="module")
def compiled(qwen2):
    """The compiled engine (nine graphs at start-up), shared by this module's tests."""
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(SCALAR_INDUCTOR):
        engine = engine_for(qwen2, compile=True)
    assert graph_counts() == {"graphs": 9, "breaks": 0}
    cache = engine.step.model.cache  # the start-up runs wrote the spare slot only
    assert not any(t[: cache.capacity].any() for t in (*cache.keys, *cache.values))
    assert all(t[cache.capacity].any() for t in cache.keys)
    return engine


def test_compiled_serving_compiles_nothing_more_and_equals_eager(qwen2, compiled):
    engine = compiled
    graph, sampled = engine.step.graph, engine.step.sample_graph
    assert sampled.buckets == (1, 2, 4, 8, 12)  # (max_rows: capacity 4 x (1 + 2))
    assert graph is not None
    counted = graph_counts()
    forward = engine.step.forward_graph
    select, buckets = forward.select, []

    def selecting(host):
        variant = select(host)
        buckets.append(None if variant is None else variant.tokens)
        return variant

    forward.select = selecting
    calls = []
    compiled = graph.fn

    def counting(*args):
        calls.append(1)
        return compiled(*args)

    graph.fn = counting
    sample_calls, sample_fn = [], sampled.fn
    scored_calls, scored_fn = [], engine.step.scorer.graph.fn

    def scoring(*args):
        scored_calls.append(1)
        return scored_fn(*args)

    engine.step.scorer.graph.fn = scoring

    def sampling(*args):
        sample_calls.append(args[0].shape[0])
        return sample_fn(*args)

    sampled.fn = sampling
    log = PlanLog(engine.step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        served = engine.run_offline(SERVING)
    assert graph_counts() == counted
    sampling_plans = sum(any(w.samples for w in p.work) for p in log.plans)
    assert len(sample_calls) == sampling_plans and len(set(sample_calls)) >= 3, sample_calls
    assert scored_calls  # (the scored prefill chunks ran the compiled block)
    assert None not in buckets and len(set(buckets)) >= 3, buckets
    assert log.kinds() == {"decode", "chunked prefill", "mixed", "speculative round",
                           "scored prefill"}
    assert len(calls) > 20
    eager = engine_for(qwen2, compile=False)
    assert eager.step.forward_graph is None
    assert_same_results(served, eager.run_offline(SERVING))


def test_the_compiled_sample_phase_equals_eager_and_compiles_nothing_more(compiled):
    """The engine's sample graphs (ranks/step/sample_graph.py: five, one row sampled or
    greedy, the dynamic bucket filtered, sampled or greedy; a single filtered row is padded to
    2) driven directly: 24 steps of every feature mix compile nothing more (error_on_recompile)
    and pick the eager capture-safe sampler's and the CPU sampler's tokens (seeded rows, the
    same seeds)."""
    import random

    from helios_logprobs.ranks.sampler.params import RowSampling
    from helios_logprobs.ranks.sampler.sampler import ShardedSampler
    from tests.unit.ranks.test_capture_compile import MIXES

    graph, safe = compiled.step.sample_graph, compiled.step.sampler
    vocab, width = safe.vocab_size, safe.local_width
    dims = (None, 0, safe.local_valid, width, vocab, safe.max_rows)
    eager = ShardedSampler(*dims, capture_safe=True)
    default = ShardedSampler(*dims)  # (the CPU's)
    gen, pick = torch.Generator().manual_seed(5), random.Random(2)
    variants, counted = set(), graph_counts()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(24):
            n = (1, 2, 3, 4)[step % 4]
            rows = [RowSampling(seed=pick.randrange(2**64), position=step,
                                **pick.choice(MIXES)) for _ in range(n)]
            history = [[pick.randrange(vocab) for _ in range(5)] for _ in range(n)]
            logits = torch.randn(n, width, generator=gen) * 3.0
            logits[0, 7] = float("nan")
            padded = graph.pad(rows, history, history)
            filtered = any(r.filtered(vocab) for r in rows)
            assert len(padded[0]) == {1: 1, 2: 2, 3: 4, 4: 4}[max(n, 1 + filtered)], rows
            graph.prepare(safe.plan(*padded))
            greedy = all(r.temperature == 0.0 for r in rows)
            assert graph.variant == ("filtered" if filtered else "greedy" if greedy
                                     else "sampled")
            variants.add((n > 1, graph.variant))
            tokens = graph.run(logits, n).clone()
            assert torch.equal(tokens, eager.sample(logits, rows, history, history)), rows
            assert torch.equal(tokens, default.sample(logits, rows, history, history)), rows
    assert graph_counts() == counted
    assert {(True, v) for v in ("filtered", "sampled", "greedy")} <= variants, variants


def test_the_graph_takes_only_its_arguments_and_the_workspaces_are_local(qwen2):
    """Dynamo's own account of the region: one graph, no break, and its inputs are exactly
    the eight buffers passed in (a workspace held as an attribute would be a ninth)."""
    from helios_logprobs.ranks.step.reduce_graph import ReductionGraph

    step = engine_for(qwen2, compile=False).step
    explained, ops = explained_reduce_region(step)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    (fx,) = explained.graphs
    inputs = [n for n in fx.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == 8
    assert ops == ["helios.whole_reduction.default"]
    graph = ReductionGraph(step.reduction, None, compile=False)
    assert not [v for v in vars(graph).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize(("flags", "compiled"), [
    ((), False), (("--compile",), True), (("--compile", "--enforce-eager"), False),
    (("--enforce-eager",), False)])
def test_the_compile_flags_reach_the_runtime_config(flags, compiled):
    from helios_logprobs.launch.arguments import runtime_config
    from helios_logprobs.launch.serve_options import parse_serve_args

    args = parse_serve_args(["--model", "tiny", *flags])
    assert runtime_config(args, "cpu").compile is compiled


def test_compile_with_the_triton_backend_needs_cuda():
    """On CUDA the default backend (Triton) compiles (its triton_ops); a CPU rank cannot run
    Triton kernels under Inductor, and the reference backend (not a command-line choice) has
    no ops."""
    from helios_logprobs.launch.arguments import runtime_config
    from helios_logprobs.launch.serve_options import parse_serve_args

    args = parse_serve_args(["--model", "tiny", "--compile", "--reduction-backend", "triton"])
    with pytest.raises(ValueError, match="'triton' needs device 'cuda'"):
        runtime_config(args, "cpu")
    with pytest.raises(ValueError, match="compile needs reduction_backend 'torch' or 'triton'"):
        replace(runtime_config(args, "cuda"), reduction_backend="reference")
