"""Prompt scoring on vocabulary shards (kernels/scoring.py) against the full-row reference
(kernels/reference.py score_reference), shards simulated in one process: exchange = stack."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.cpu import lean as torch_lean
from helios_logprobs.kernels.layout import (
    PROMPT_EXCHANGE_WORDS,
    PROMPT_FIRST_PAIR,
    PROMPT_RANK,
    PROMPT_ROW_WORDS,
    PROMPT_TARGET_BITS,
)
from helios_logprobs.kernels.reference import reference_logprobs, score_reference
from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring
from helios_logprobs.kernels.scoring.lean import count_above_fast
from helios_logprobs.kernels.scoring.steps import (
    score_candidates,
    score_merge,
    score_stats,
    target_values,
)
from helios_logprobs.kernels.sortkeys import bits_to_float
from helios_logprobs.ranks.step.scoring import scored_capacities


def split(vocab: int, world: int, width: int | None = None) -> list[tuple[int, int, int]]:
    """(vocab_start, local_valid, width) per rank: ceil-divided shards, padding at the end."""
    per = width or -(-vocab // world)
    return [(min(r * per, vocab), max(0, min(vocab - r * per, per)), per) for r in range(world)]


def simulate(logits: torch.Tensor, targets: torch.Tensor, world: int) -> torch.Tensor:
    vocab = logits.shape[1]
    shards = split(vocab, world)
    padded = torch.full((logits.shape[0], shards[0][2] * world), -7.0, dtype=logits.dtype)
    padded[:, :vocab] = logits
    starts = [s for s, _, _ in shards]
    starts = [*[min(s, vocab) for s in starts], vocab]
    n = logits.shape[0]
    e1, stats = [], []
    for r, (start, valid, width) in enumerate(shards):
        local = padded[:, r * width : (r + 1) * width]
        words = torch.full((n, PROMPT_EXCHANGE_WORDS), 99, dtype=torch.int32)
        stats.append(score_stats(local, targets, start, valid, words))
        e1.append(words)
    e1_all = torch.stack(e1)
    outs, e2 = [], []
    for r, (start, valid, width) in enumerate(shards):
        local = padded[:, r * width : (r + 1) * width]
        lse, value = target_values(e1_all, targets, starts)
        words = torch.full((n, PROMPT_EXCHANGE_WORDS), 99, dtype=torch.int32)
        score_candidates(local, stats[r], lse, value, start, valid, words)
        e2.append(words)
    e2_all = torch.stack(e2)
    for _ in range(world):
        lse, value = target_values(e1_all, targets, starts)
        outs.append(score_merge(e2_all, targets, value, torch.empty(n, PROMPT_ROW_WORDS,
                                                                     dtype=torch.int32)))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # every rank writes the same rows
    return outs[0]


def check_rows(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Equal to the reference except where FP32 rounding may move a value: ids and ranks
    exactly, values within 2 ulp of the reference's FP32 values."""
    want = score_reference(logits, targets)
    values = reference_logprobs(logits)
    for row in range(out.shape[0]):
        got, ref = out[row], want[row]
        if int(targets[row]) < 0:
            assert torch.equal(got[:PROMPT_TARGET_BITS], ref[:PROMPT_TARGET_BITS])
            assert torch.isnan(bits_to_float(got[PROMPT_TARGET_BITS : PROMPT_TARGET_BITS + 1]))
            assert int(got[PROMPT_RANK]) == 0 and (got[PROMPT_FIRST_PAIR:] == -1).all()
            continue
        got_v = bits_to_float(got[PROMPT_TARGET_BITS : PROMPT_TARGET_BITS + 1])
        ref_v = bits_to_float(ref[PROMPT_TARGET_BITS : PROMPT_TARGET_BITS + 1])
        assert torch.allclose(got_v, ref_v, rtol=0, atol=2e-6 * (1 + float(ref_v.abs())))
        assert int(got[PROMPT_RANK]) == int(ref[PROMPT_RANK]), row
        pairs = got[PROMPT_FIRST_PAIR:].view(-1, 2)
        ids = pairs[:, 0].tolist()
        ref_ids = ref[PROMPT_FIRST_PAIR:].view(-1, 2)[:, 0].tolist()
        if ids != ref_ids:  # only near-ties may reorder
            gv = values[row, [i for i in ids if i >= 0]]
            rv = values[row, [i for i in ref_ids if i >= 0]]
            assert torch.allclose(gv, rv, atol=1e-6), (row, ids, ref_ids)
        live = pairs[:, 0] >= 0
        want_v = values[row, pairs[live, 0].long()]
        assert torch.allclose(bits_to_float(pairs[live, 1].contiguous()), want_v, rtol=0,
                              atol=2e-6 * (1 + float(want_v.abs().max())))
        assert int(live.sum()) == min(20, logits.shape[1])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [7, 21, 423, 5000])
def test_sharded_scoring_equals_the_reference(world, vocab):
    gen = torch.Generator().manual_seed(vocab * 10 + world)
    rows = 9
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3] = -1  # the prompt end
    # Ties: a row of equal values ranks every id 1 and orders alternatives by id.
    logits[4] = 1.5
    # The target is the row's maximum: rank 1.
    targets[5] = int(logits[5].float().argmax())
    check_rows(simulate(logits, targets, world), logits, targets)


def test_ranks_count_ties_made_by_the_subtraction():
    """Two raw logits that differ but round to the same reported value share a rank."""
    lse_shift = 2.0**20
    logits = torch.tensor([[lse_shift, lse_shift + 0.0625, lse_shift - 30.0, 0.0]])
    targets = torch.tensor([0])
    out = simulate(logits, targets, 2)
    values = reference_logprobs(logits)[0]
    assert int(out[0, PROMPT_RANK]) == 1 + int((values > values[0]).sum())
    check_rows(out, logits, targets)


def test_non_finite_rows_report_nan_and_no_alternatives():
    logits = torch.randn(2, 50)
    logits[1, 7] = float("nan")
    out = simulate(logits, torch.tensor([3, 3]), 2)
    assert torch.isnan(bits_to_float(out[1, PROMPT_TARGET_BITS : PROMPT_TARGET_BITS + 1]))
    assert (out[1, PROMPT_FIRST_PAIR:] == -1).all()
    check_rows(out[:1], logits[:1], torch.tensor([3]))


def test_driver_at_tp1_and_block_limit():
    scoring = PreparedPromptScoring(None, width=423, vocab_start=0, local_valid=423,
                                    vocab_size=423)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 423, generator=gen) * 3
    targets = torch.randint(0, 423, (64,), generator=gen)
    out = torch.empty(64, PROMPT_ROW_WORDS, dtype=torch.int32)
    check_rows(scoring(logits, targets, out), logits, targets)
    with pytest.raises(ValueError, match="at most 64 rows"):
        scoring(torch.randn(65, 423), torch.zeros(65, dtype=torch.int64),
                torch.empty(65, PROMPT_ROW_WORDS, dtype=torch.int32))


def test_qwen_sized_vocabulary_at_tp4():
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 151_936, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.tensor([5, 151_935, -1])
    check_rows(simulate(logits, targets, 4), logits, targets)


@pytest.mark.parametrize(("chunk_limit", "ladder"), [
    (1, (1,)),
    (64, (64,)),
    (128, (128,)),
    (129, (128, 129)),
    (256, (128, 256)),
    (512, (128, 512)),
    (513, (128, 512, 513)),
    (2048, (128, 512, 2048)),
    (8192, (128, 512, 2048, 8192)),
])
def test_scored_capacity_ladder(chunk_limit, ladder):
    """The contract: capacities start at 128 and grow by factors of four below the chunk
    limit, which is always the largest capacity (written out, not derived)."""
    assert scored_capacities(chunk_limit) == ladder


def test_scored_capacity_ladder_refuses_a_chunk_limit_below_one():
    with pytest.raises(ValueError, match="chunk limit must be >= 1"):
        scored_capacities(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("world", "vocab"), [(1, 7), (3, 423), (1, 5000), (3, 40_000),
                                              (2, 151_936)])
def test_the_cpu_fast_path_writes_the_torch_paths_words(monkeypatch, world, vocab, dtype):
    """kernels/scoring/lean.py (the reduction's compiled launches) against the slab-by-slab
    torch steps: the same rows word for word, with ties made by equal logits, -inf lanes, a
    NaN row, a +inf row and an invalid target; and the fast path is the one taken where the
    compiled library loads."""
    gen = torch.Generator().manual_seed(vocab + world)
    rows = 9
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[1, ::3] = float("-inf")
    logits[2] = 0.5
    logits[4, vocab // 2] = float("nan")
    logits[5, 0] = float("inf")
    logits[6, : min(vocab, 40)] = logits[6].max()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3] = -1
    fast = simulate(logits, targets, world)
    if compiled.available():
        lse, value = torch.zeros(rows), torch.full((rows,), -1.0)
        assert count_above_fast(logits, vocab, lse, value) is not None
    monkeypatch.setattr(torch_lean, "LEAN", False)
    slow = simulate(logits, targets, world)
    assert torch.equal(fast, slow)
