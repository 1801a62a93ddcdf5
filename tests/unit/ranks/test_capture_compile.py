"""The capture-safe sample phase and prompt scoring compiled with
``torch.compile(fullgraph=True)`` on CPU (issue 36): their launches are custom ops
(ranks/sampler/ops.py, kernels/scoring/ops.py), so dynamo traces each whole (fullgraph raises
on a graph break). A sampler of one row has no bucket of 2 and keeps a filtered row at one row;
scoring blocks of different row counts (padded with target -1 rows) compile nothing after
construction (dynamo's counters) and their words are bit-equal to an eager block of the real
rows. The compiled sample phase's graphs serving every feature mix are checked on the compiled
engine's own (tests/unit/ranks/test_compiled_reduction.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from helios_logprobs.kernels.layout import PROMPT_BLOCK_ROWS, PROMPT_ROW_WORDS
from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

pytestmark = pytest.mark.slow

VOCAB, PAD, BUCKET = 300, 4, 4


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    return int(sum(counters["graph_break"].values()))


MIXES = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.9, top_k=5),
         dict(temperature=1.1, top_p=0.7), dict(temperature=0.7, min_p=0.1),
         dict(temperature=1.3, top_k=280, top_p=0.9), dict(temperature=0.6, presence_penalty=0.5),
         dict(temperature=0.0, repetition_penalty=1.3),
         dict(temperature=1.0, logit_bias=((3, 5.0),)),
         dict(temperature=1.2, top_k=40, top_p=0.95, min_p=0.05, frequency_penalty=0.2)]
"""Greedy, temperature, top-k (<= 256 and > 256: the two eager paths), top-p, min-p, the
penalties and logit_bias (the eager processors before the graph), and all of them at once."""


def test_one_row_samplers_keep_the_single_filtered_row_at_one_row():
    """With max_rows 1 there is no bucket of 2: a filtered row runs at bucket 1 (the
    region, uncompiled here, equals the eager capture-safe sampler)."""
    from helios_logprobs.ranks.step.sample_graph import SampleGraph

    safe = ShardedSampler(None, 0, VOCAB, VOCAB + PAD, VOCAB, 1, capture_safe=True)
    graph = SampleGraph(safe, None, compile=False)
    eager = ShardedSampler(None, 0, VOCAB, VOCAB + PAD, VOCAB, 1, capture_safe=True)
    assert graph.buckets == (1,) and graph.smallest_filtered == 1
    gen = torch.Generator().manual_seed(3)
    for step, mix in enumerate(MIXES):
        rows = [RowSampling(seed=11 + step, position=step, **mix)]
        padded = graph.pad(rows, [[1, 2]], [[3]])
        assert len(padded[0]) == 1
        logits = torch.randn(1, VOCAB + PAD, generator=gen) * 3.0
        graph.prepare(safe.plan(*padded))
        assert torch.equal(graph.run(logits, 1), eager.sample(logits, rows, [[1, 2]], [[3]]))


def test_a_compiled_scoring_block_equals_eager_and_compiles_once():
    torch._dynamo.reset()
    counters.clear()
    width, valid = 423, 419
    scoring = PreparedPromptScoring(None, width=width, vocab_start=0, local_valid=valid,
                                    vocab_size=valid)
    compiled = torch.compile(scoring.__call__, fullgraph=True)
    eager = PreparedPromptScoring(None, width=width, vocab_start=0, local_valid=valid,
                                  vocab_size=valid)
    gen = torch.Generator().manual_seed(9)
    block = torch.empty(PROMPT_BLOCK_ROWS, width, dtype=torch.bfloat16)
    out = torch.empty(PROMPT_BLOCK_ROWS, PROMPT_ROW_WORDS, dtype=torch.int32)
    graphs = []
    for n in (5, 64, 17, 40):
        block.copy_(torch.randn(PROMPT_BLOCK_ROWS, width, generator=gen) * 3.0)
        block[:, valid:] = 0.0
        targets = torch.full((PROMPT_BLOCK_ROWS,), -1, dtype=torch.int32)
        targets[:n] = torch.randint(valid, (n,), generator=gen, dtype=torch.int32)
        targets[n // 2] = -1  # (a prompt end inside the real rows)
        compiled(block, targets, out)
        graphs.append(compiled_graphs())
        want = torch.empty(n, PROMPT_ROW_WORDS, dtype=torch.int32)
        eager(block[:n].clone(), targets[:n].clone(), want)
        assert torch.equal(out[:n], want)
        assert (want[:, 0] == targets[:n]).all()  # (the rows were scored, not left as -1)
    assert graphs == [1] * 4
    assert graph_breaks() == 0


def test_compiled_prompt_scoring_equals_eager_and_compiles_once(tmp_path):
    """The scored-prefill chunk under --compile (ranks/step/scoring.py CompiledBlock): the
    projection and the scoring block compiled at the padded 64-row shape at construction,
    then chunks of 100, 7 and 64 rows (two blocks, one short, one full) compile nothing more
    and give the eager scorer's rows: ids and ranks equal, logprobs within 1e-5."""
    from helios_logprobs.ranks.model.llama import ShardedCausalLM
    from helios_logprobs.ranks.step.scoring import PromptScorer
    from tests.checkpoints import write_qwen2

    model = ShardedCausalLM.load(write_qwen2(tmp_path / "qwen2"))
    torch._dynamo.reset()
    counters.clear()
    compiled = PromptScorer(model, None, 128, torch.device("cpu"), compile=True)
    assert (compiled_graphs(), graph_breaks()) == (1, 0)
    eager = PromptScorer(model, None, 128, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    hidden_size = model.weights.lm_head.shape[1]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for frame, n in enumerate((100, 7, 64)):
            hidden = torch.randn(n, hidden_size, generator=gen).to(model.dtype)
            targets = tuple(torch.randint(model.vocab_size, (n,), generator=gen).tolist())
            targets = (*targets[:-1], -1)  # (the prompt's end)
            got, want = (s.frames_for(n).prompt_logprobs[frame % 2] for s in (compiled,
                                                                               eager))
            compiled(frame % 2, hidden, targets)
            eager(frame % 2, hidden, targets)
            got, want = got[:n], want[:n]
            assert (want[:-1, 0] >= 0).all() and want[-1, 0] == -1
            ids = [0, 2, *range(3, PROMPT_ROW_WORDS, 2)]
            values = [1, *range(4, PROMPT_ROW_WORDS, 2)]
            assert torch.equal(got[:, ids], want[:, ids])
            torch.testing.assert_close(got[:-1, values].view(torch.float32),
                                       want[:-1, values].view(torch.float32), rtol=0,
                                       atol=1e-5)
    assert (compiled_graphs(), graph_breaks()) == (1, 0)
