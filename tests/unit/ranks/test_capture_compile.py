"""The capture-safe sample phase and a prompt scoring block, each compiled with
``torch.compile(fullgraph=True)`` on CPU (issue 36): their launches are custom ops
(ranks/sampler/ops.py, kernels/scoring/ops.py), so dynamo traces each whole (fullgraph raises
on a graph break). Several steps of different row counts within one bucket (rows padded to
the bucket: greedy filler rows for the sampler, target -1 rows for scoring) compile one graph
and nothing more (dynamo's counters), and equal eager: the sampler's tokens equal the eager
capture-safe sampler's and the CPU's default sampler's on the unpadded rows, the scored rows'
words are bit-equal to an eager block of the real rows."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from helios_logprobs.kernels.layout import PROMPT_BLOCK_ROWS, PROMPT_ROW_WORDS
from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.plan import pad_rows
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

VOCAB, PAD, BUCKET = 300, 4, 4


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    return int(sum(counters["graph_break"].values()))


def test_the_compiled_sample_phase_equals_eager_and_compiles_once_per_bucket():
    torch._dynamo.reset()
    counters.clear()
    safe = ShardedSampler(None, 0, VOCAB, VOCAB + PAD, VOCAB, BUCKET, capture_safe=True)
    compiled = torch.compile(safe.run, fullgraph=True)
    eager = ShardedSampler(None, 0, VOCAB, VOCAB + PAD, VOCAB, BUCKET, capture_safe=True)
    default = ShardedSampler(None, 0, VOCAB, VOCAB + PAD, VOCAB, BUCKET)  # (the CPU's)
    gen = torch.Generator().manual_seed(5)
    steps = [(0.8, 0.0), (0.0, 1.3, 0.5), (0.7,), (0.0, 0.0, 0.9, 1.0), (2.0, 0.0, 0.3)]
    graphs = []
    for step, temperatures in enumerate(steps):
        n = len(temperatures)
        rows = [RowSampling(seed=977 * step + 31 * i + (2**63 if i == 1 else 0), position=step,
                            temperature=t) for i, t in enumerate(temperatures)]
        logits = torch.randn(BUCKET, VOCAB + PAD, generator=gen) * 2.0
        logits[0, 7] = float("nan")
        history = [[4, 9, step]] * n
        plan = safe.plan(*pad_rows(rows, history, history, BUCKET))
        tokens = compiled(logits, plan)[:n].clone()
        graphs.append(compiled_graphs())
        real = logits[:n]
        assert torch.equal(tokens, eager.sample(real, rows, history, history))
        assert torch.equal(tokens, default.sample(real, rows, history, history))
    assert graphs == [1] * len(steps)
    assert graph_breaks() == 0


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
