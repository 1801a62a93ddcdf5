"""The coordinator's decoding of scored prompt rows (runtime/engine/prompt_reader.py): rows
from the real scoring driver decode to the float64 reference's values and alternatives, and a
row missing an alternative it owes fails the request instead of dropping the entry."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.kernels.layout import PROMPT_FIRST_PAIR, PROMPT_ROW_WORDS
from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring
from helios_logprobs.ranks.plan import SlotWork
from helios_logprobs.runtime.engine.prompt_reader import decode_prompt_rows
from helios_logprobs.runtime.outputs import EngineError


def scored_rows(vocab: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                                  SlotWork]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    scoring = PreparedPromptScoring(None, width=vocab, vocab_start=0, local_valid=vocab,
                                    vocab_size=vocab)
    out = torch.empty(rows, PROMPT_ROW_WORDS, dtype=torch.int32)
    scoring(logits, targets, out)
    work = SlotWork(slot=1, epoch=1, tokens=tuple(range(rows)), start=4, samples=False,
                    targets=tuple(targets.tolist()))
    return logits, out, work


@pytest.mark.parametrize(("vocab", "top_n"), [(423, 5), (423, 20), (7, 20), (7, 3)])
def test_rows_decode_to_the_reference(vocab, top_n):
    logits, out, work = scored_rows(vocab, rows=6)
    reference = logits.double().log_softmax(-1)
    entries = decode_prompt_rows(out.numpy(), work, top_n, vocab)
    assert [e.position for e in entries] == [work.start + j + 1 for j in range(6)]
    for j, entry in enumerate(entries):
        assert entry.token_id == work.targets[j]
        assert entry.logprob == pytest.approx(float(reference[j, entry.token_id]), abs=1e-5)
        best = reference[j].topk(min(top_n, vocab))
        assert [a.token_id for a in entry.alternatives] == best.indices.tolist()
        for alternative, value in zip(entry.alternatives, best.values.tolist(), strict=True):
            assert alternative.logprob == pytest.approx(value, abs=1e-5)


def test_a_missing_alternative_fails_the_request():
    _, out, work = scored_rows(423, rows=3)
    out[1, PROMPT_FIRST_PAIR + 2 * 4] = -1  # (the fifth alternative's id)
    assert len(decode_prompt_rows(out.numpy(), work, 4, 423)) == 3  # (not one it owes)
    with pytest.raises(EngineError, match="prompt position 6: alternative ids"):
        decode_prompt_rows(out.numpy(), work, 5, 423)


def test_an_alternative_outside_the_vocabulary_fails_the_request():
    _, out, work = scored_rows(423, rows=2)
    out[0, PROMPT_FIRST_PAIR] = 423
    with pytest.raises(EngineError, match="outside the vocabulary of 423"):
        decode_prompt_rows(out.numpy(), work, 1, 423)
