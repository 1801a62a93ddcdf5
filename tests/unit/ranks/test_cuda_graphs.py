"""The captured decode step's bookkeeping on the CPU (ranks/step/cuda_graphs.py, issue 36):
which submissions replay, one pool shared by every variant captured largest first, and served
runs whose decode submissions replay the captured variants (through a backend that keeps the
captured callables and replays them under a strict host-sync guard): the reduce phase alone
answers exactly what the eager engine answers; with the compiled forward's decode buckets
(ranks/step/forward_graph.py, uncompiled here) the same tokens, logprobs within 1e-5.
tests/gpu/test_cuda_graphs_gpu.py replays real CUDA graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helios_logprobs.ranks.plan import RequestSpec, SlotWork, StepPlan
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.step.cuda_graphs import (
    DECODE,
    REDUCE,
    DecodeGraphs,
    GraphKey,
    GraphSet,
    decode_graphs,
    decode_rows,
)
from helios_logprobs.ranks.step.forward_graph import ForwardGraph
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import GeneratedToken
from tests.capture_guard import HostSyncGuard
from tests.checkpoints import write_llama


def work(slot: int, tokens: tuple[int, ...], start: int = 4, samples: bool = True, **extra):
    return SlotWork(slot=slot, epoch=1, tokens=tokens, start=start, samples=samples, **extra)


def test_only_uniform_decode_submissions_replay():
    decode = (work(0, (5,)), work(2, (6,)), work(1, (7,)))
    assert decode_rows(StepPlan(3, decode)) == 3
    assert decode_rows(StepPlan(3, decode, entropy=True)) == 0
    assert decode_rows(StepPlan(3, ())) == 0
    others = {
        "a prefill chunk": work(3, (1, 2, 3)),
        "a chunk that does not sample": work(3, (1,), samples=False),
        "a speculative round": work(3, (1, 2), proposals=(2,)),
        "a scored chunk": work(3, (1,), targets=(4,)),
        "a grammar-masked row": work(3, (1,), grammar_masks=(b"\xff",)),
    }
    for name, other in others.items():
        assert decode_rows(StepPlan(3, (*decode, other))) == 0, name
    # A one-token prompt's first chunk is a decode-shaped row (admission is prepare's).
    first = work(3, (9,), start=0, 
                 request=RequestSpec(0, 4, RowSampling(seed=1, position=0)))
    assert decode_rows(StepPlan(3, (*decode, first))) == 4


class KeptCallables:
    """A capture backend for the CPU: one pool object, a capture keeps the callable (after
    ``warmup`` eager calls) and a replay calls it under a strict host-sync guard, so a
    variant that reads a tensor on the host, or builds one from host data, fails."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.pools: list[object] = []
        self.captured: list[tuple[object, object]] = []  # (pool, callable)
        self.guard = HostSyncGuard(strict=("replay",))

    def pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn, pool):
        for _ in range(self.warmup):
            fn()
        self.captured.append((pool, fn))
        backend = self

        class Graph:
            def replay(self) -> None:
                with backend.guard.running("replay"):
                    fn()

        return Graph()


def test_every_variant_captures_into_one_pool_largest_first():
    backend, order = KeptCallables(warmup=0), []
    graphs = GraphSet(backend)
    keys = [GraphKey(DECODE, s) for s in (1, 2, 4, 8)] + [GraphKey(REDUCE, 8, f) for f in (1, 0)]
    graphs.capture({k: (lambda k=k: order.append(k)) for k in keys})
    assert len(backend.pools) == 1 and {p for p, _ in backend.captured} == {graphs.pool}
    for _, fn in backend.captured:
        fn()
    assert order == [GraphKey(DECODE, 8), GraphKey(REDUCE, 8, 0), GraphKey(REDUCE, 8, 1),
                     GraphKey(DECODE, 4), GraphKey(DECODE, 2), GraphKey(DECODE, 1)]
    graphs.replay(GraphKey(DECODE, 2))
    assert order[-1] == GraphKey(DECODE, 2) and graphs.counters.replays[DECODE] == 1
    with pytest.raises(ValueError, match="captured already"):
        graphs.capture({GraphKey(DECODE, 1): lambda: None})
    with pytest.raises(ValueError, match="phase"):
        GraphKey("sample", 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


def jobs() -> list[tuple[list[int], SamplingParams]]:
    """Decode batches of 1 to 4 rows (requests of different lengths end one by one), K=20,
    K=3, selected IDs and plain lanes; prefill chunks between them stay eager."""
    def params(tokens: int, **extra) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)

    return [([5, 6, 7], params(14, logprobs=20)), ([8, 9], params(5, logprobs=3)),
            ([4, 5], params(9, logprob_token_ids=(100, 7, 250))), ([3, 1, 4], params(11)),
            ([2, 7, 1, 8, 2, 8], params(7, logprobs=20))]


def generated(results) -> list[list[GeneratedToken]]:
    return [[e for e in events if isinstance(e, GeneratedToken)] for events in results]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_served_decode_replays_the_captured_reduce_and_answers_as_eager(model_dir, mode):
    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=64,
                           logprobs_mode=mode)
    eager = generated(build_engine(config, load_rank(config, None)).run_offline(jobs()))
    step = load_rank(config, None)
    assert step.cuda_graphs is None  # (the CPU: nothing captured by default)
    step.config = replace(step.config, cuda_graphs=True)
    assert decode_graphs(step) is None  # (cuda_graphs asks for CUDA; this is the CPU)
    backend = KeptCallables()
    step.cuda_graphs = DecodeGraphs(step, backend)
    assert [key for key in step.cuda_graphs.graphs.graphs] == [
        GraphKey(REDUCE, 4, 0), GraphKey(REDUCE, 4, 1)]
    served = generated(build_engine(config, step).run_offline(jobs()))
    assert served == eager
    assert any(t.logprob is not None for tokens in served for t in tokens)
    counters = step.cuda_graphs.counters
    assert counters.replays[REDUCE] > 10 and counters.eager > 0
    assert backend.guard.guarded["replay"] == counters.replays[REDUCE]


def close(a: list[list[GeneratedToken]], b: list[list[GeneratedToken]]) -> None:
    """The same tokens and alternatives, logprobs within 1e-5."""
    assert [[t.token_id for t in r] for r in a] == [[t.token_id for t in r] for r in b]
    for x, y in zip((t for r in a for t in r), (t for r in b for t in r), strict=True):
        assert (x.logprob is None) == (y.logprob is None)
        if x.logprob is not None:
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [p.token_id for p in x.alternatives] == [p.token_id for p in y.alternatives]
        for p, q in zip(x.alternatives, y.alternatives, strict=True):
            assert p.logprob == pytest.approx(q.logprob, abs=1e-5)


def test_served_decode_replays_the_compiled_forward_buckets(model_dir):
    """The compiled forward's decode buckets (uncompiled here: the callables are what a CUDA
    graph captures) beside the reduce phase; prefill runs uncaptured."""
    config = RuntimeConfig(model_dir=model_dir, capacity=3, max_model_len=64)
    eager = generated(build_engine(config, load_rank(config, None)).run_offline(jobs()))
    step = load_rank(config, None)
    cfg = step.config
    step.model.allocate_cache(cfg.capacity, cfg.max_seq_len, spare_slots=1)
    step.forward_graph = ForwardGraph(step.model, cfg.capacity, cfg.max_seq_len, cfg.max_rows,
                                      cfg.token_budget, step.device, compile=False)
    backend = KeptCallables()
    step.cuda_graphs = DecodeGraphs(step, backend)
    assert step.cuda_graphs.forward_capture.sizes == (1, 2, 4)  # (the ladder up to 3 rows)
    assert list(step.cuda_graphs.graphs.graphs) == [
        GraphKey(DECODE, 4), GraphKey(REDUCE, 3, 0), GraphKey(REDUCE, 3, 1), GraphKey(DECODE, 2),
        GraphKey(DECODE, 1)]
    served = generated(build_engine(config, step).run_offline(jobs()))
    close(served, eager)
    counters = step.cuda_graphs.counters
    assert counters.replays[DECODE] == counters.replays[REDUCE] > 10
    assert backend.guard.guarded["replay"] == counters.replays[DECODE] + counters.replays[REDUCE]
