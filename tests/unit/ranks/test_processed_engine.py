"""--logprobs-mode processed_logprobs through a whole TP1 engine (prepare, forward, sample,
commit, reduce, frame copy, decoding): every generated entry equals transformers' logits of
the same checkpoint through vLLM's processors (tests/sampler_oracle.py) renormalized in
float64, with and without speculative rounds (which verify on the same processed rows); the
raw engine's entries for the same tokens are transformers' raw log_softmax."""

from __future__ import annotations

import math

import pytest
import torch

from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import GeneratedToken
from tests import sampler_oracle as oracle
from tests.checkpoints import _hf_model, write_qwen2

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
JOBS = [
    (PROMPT, SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=3, logprobs=8,
                            ignore_eos=True)),
    (PROMPT, SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.4,
                            logprobs=3, ignore_eos=True)),
    ([9, 10, 11, 9, 10, 11, 9, 10], SamplingParams(
        max_tokens=10, temperature=1.3, top_p=0.9, min_p=0.05, frequency_penalty=0.5, seed=8,
        logprobs=5, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def serve(model_dir, mode: str, n: int, compile: bool = False):
    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=96,
                           speculative_tokens=n, ngram_min=1, ngram_max=3, logprobs_mode=mode,
                           compile=compile)
    engine = build_engine(config, load_rank(config, None))
    results = [[e for e in events if isinstance(e, GeneratedToken)]
               for events in engine.run_offline(JOBS)]
    return results, engine.speculation


@pytest.fixture(scope="module")
def runs(qwen2):
    return {(mode, n): serve(qwen2, mode, n)
            for mode, n in (("processed_logprobs", 0), ("processed_logprobs", 2),
                            ("raw_logprobs", 0))}


def oracle_rows(model_dir, prompt: list[int], tokens: list[int], params: SamplingParams,
                processed: bool) -> list[torch.Tensor]:
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt + tokens])).logits[0].float()
    rows = []
    for j in range(len(tokens)):
        x = logits[len(prompt) - 1 + j]
        if processed:
            row = RowSampling(seed=params.seed or 0, position=j, temperature=params.temperature,
                              top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                              frequency_penalty=params.frequency_penalty,
                              repetition_penalty=params.repetition_penalty)
            x = oracle.final(x, row, prompt, tokens[:j])
        x = x.to(torch.float64)
        rows.append(x - torch.logsumexp(x, 0))
    return rows


def check(model_dir, results, processed: bool) -> int:
    """Entries against the oracle; returns how many alternatives were masked (-inf)."""
    masked = 0
    for (prompt, params), tokens in zip(JOBS, results, strict=True):
        ids = [t.token_id for t in tokens]
        assert len(ids) == params.max_tokens
        for t, want in zip(tokens, oracle_rows(model_dir, prompt, ids, params, processed),
                           strict=True):
            assert abs(t.logprob - float(want[t.token_id])) <= TOLERANCE
            assert len(t.alternatives) == params.logprobs
            for alt in t.alternatives:
                if math.isinf(want[alt.token_id]):
                    assert alt.logprob == -math.inf
                    masked += 1
                else:
                    assert abs(alt.logprob - float(want[alt.token_id])) <= TOLERANCE
            best = sorted(range(want.numel()), key=lambda i: (-float(want[i]), i))
            finite = [i for i in best[: params.logprobs] if math.isfinite(want[i])]
            assert set(finite) <= {a.token_id for a in t.alternatives}
    return masked


def test_processed_entries_equal_vllms_processors_on_transformers(runs, qwen2):
    results, _ = runs[("processed_logprobs", 0)]
    assert check(qwen2, results, processed=True) >= 10 * (8 - 5)  # top-k 5 of 8 asked


def test_speculative_rounds_report_the_same_processed_entries(runs, qwen2):
    base, _ = runs[("processed_logprobs", 0)]
    spec, counters = runs[("processed_logprobs", 2)]
    assert counters.accepted > 0
    check(qwen2, spec, processed=True)
    for a, b in zip(base, spec, strict=True):
        assert [t.token_id for t in a] == [t.token_id for t in b]


def test_raw_engine_samples_the_same_tokens_and_reports_raw_entries(runs, qwen2):
    raw, _ = runs[("raw_logprobs", 0)]
    base, _ = runs[("processed_logprobs", 0)]
    assert check(qwen2, raw, processed=False) == 0
    for a, b in zip(base, raw, strict=True):
        assert [t.token_id for t in a] == [t.token_id for t in b]


def test_compiled_reduce_phase_reads_the_processed_rows(runs, qwen2):
    """--compile: the reduce phase's graph reads the same scratch rows: the same tokens and
    entries as the eager engine with the same speculation (within 2e-5: the compiled
    forward's logits round differently from eager's). The engine is the compiled serving
    tests' (tests/serving_engines.py: the same graphs, so Inductor's cache may serve them)."""
    from tests.serving_engines import SCALAR_INDUCTOR, serving_engine

    with torch._inductor.config.patch(SCALAR_INDUCTOR):
        engine = serving_engine(qwen2, compile=True, logprobs_mode="processed_logprobs")
    assert engine.step.graph is not None and engine.step.sample_graph is not None
    compiled = [[e for e in events if isinstance(e, GeneratedToken)]
                for events in engine.run_offline(JOBS)]
    eager = runs[("processed_logprobs", 2)][0]
    for a, b in zip(compiled, eager, strict=True):
        assert [t.token_id for t in a] == [t.token_id for t in b]
        for x, y in zip(a, b, strict=True):
            assert [p.token_id for p in x.alternatives] == [p.token_id for p in y.alternatives]
            pairs = [(p.logprob, q.logprob) for p, q in zip(x.alternatives, y.alternatives,
                                                            strict=True)]
            for p, q in [(x.logprob, y.logprob), *pairs]:
                assert p == q or math.isclose(p, q, abs_tol=2e-5), (p, q)


class EntropyRecorder:
    """The step's StepReduction, called with ``entropy=True``; records each gated row's
    (slot, position, value written to entropy_frames)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seen: list[tuple[int, int, float]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, frame, logits, row_slots, row_epochs, row_positions=None,
                 row_tensors=None, entropy=False):
        # Every call reduces with entropy, whatever the plan asked (the test reads all rows).
        inner = self.inner
        inner(frame, logits, row_slots, row_epochs, row_positions, row_tensors, entropy=True)
        for r in torch.nonzero(inner.requested[: logits.shape[0]]).flatten().tolist():
            slot, position = row_slots[r], (row_positions or [0] * len(row_slots))[r]
            written = float(inner.entropy_frames[frame, slot, position])
            assert written == float(inner.entropy[r])
            self.seen.append((slot, position, written))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_step_reduction_writes_the_reported_distributions_entropy(qwen2, mode: str):
    from tests.entropy_cases import reference_entropy

    config = RuntimeConfig(model_dir=qwen2, capacity=4, max_model_len=96, logprobs_mode=mode)
    engine = build_engine(config, load_rank(config, None))
    recorder = engine.step.reduction = EntropyRecorder(engine.step.reduction)
    prompt, params = JOBS[2]
    tokens = [e for e in engine.run_offline([(prompt, params)])[0]
              if isinstance(e, GeneratedToken)]
    ids = [t.token_id for t in tokens]
    assert [p for _, p, _ in recorder.seen] == [0] * len(ids)
    with torch.no_grad():
        logits = _hf_model(str(qwen2))(torch.tensor([prompt + ids])).logits[0].float()
    for j, (_, _, got) in enumerate(recorder.seen):
        x = logits[len(prompt) - 1 + j]
        if mode == "processed_logprobs":
            row = RowSampling(seed=params.seed, position=j, temperature=params.temperature,
                              top_p=params.top_p, min_p=params.min_p,
                              frequency_penalty=params.frequency_penalty)
            x = oracle.final(x, row, prompt, ids[:j])
        assert abs(got - float(reference_entropy(x))) <= TOLERANCE, (j, got)
