"""The grammar bitmask on vocabulary shards: each rank slices the coordinator's full-vocabulary
row at its own range, and the sampler's scratch rows of all shards together equal the
full-vocabulary reference (the logits with -inf wherever the grammar forbids the id). The raw
logits stay untouched (the reduction reads them: reported logprobs precede the grammar)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helios_logprobs.ranks.grammar_mask import allowed_ids, bitmask_words, shard_blocked
from helios_logprobs.ranks.model.sharding import vocab_shard
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

NEG_INF = float("-inf")


def random_row(vocab: int, seed: int, density: float = 0.3) -> tuple[bytes, np.ndarray]:
    """(a bitmask row as xgrammar lays it out, the allowed ids as bools) built independently:
    bit (id % 32) of little-endian int32 word id // 32."""
    rng = np.random.default_rng(seed)
    allowed = rng.random(vocab) < density
    allowed[rng.integers(vocab)] = True
    words = np.zeros(bitmask_words(vocab), dtype=np.uint32)
    for token in np.nonzero(allowed)[0]:
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return words.astype("<u4").tobytes(), allowed


@pytest.mark.parametrize("vocab", [431, 321, 64])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_slices_join_to_the_full_row(vocab, tp):
    row, allowed = random_row(vocab, vocab + tp)
    assert np.array_equal(allowed_ids(row, vocab), allowed)
    pieces = []
    for rank in range(tp):
        start, _, valid = vocab_shard(vocab, tp, rank)
        pieces.append(shard_blocked([row], start, valid, vocab, torch.device("cpu"))[0])
    assert torch.equal(torch.cat(pieces), torch.from_numpy(~allowed))


def test_a_row_of_the_wrong_size_is_refused():
    row, _ = random_row(100, 1)
    with pytest.raises(ValueError, match="bytes"):
        shard_blocked([row + b"\0\0\0\0"], 0, 100, 100, torch.device("cpu"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sampler_scratch_on_every_shard_equals_the_masked_full_vocabulary(tp, temperature):
    """TP shards (vocabulary 431: TP2 does not divide it into words) each run the sampler on
    their own logit columns; their scratch rows, joined, equal the full-vocabulary logits
    masked by the grammar (scaled by the temperature), and the raw logits are unchanged."""
    vocab, n = 431, 3
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(n, vocab, generator=gen)
    masks = [random_row(vocab, 100 + i) for i in range(n)]
    rows = [RowSampling(seed=i, position=i, temperature=temperature,
                        grammar_bitmask=masks[i][0] if i != 1 else None) for i in range(n)]
    expected = logits.clone()
    for i, (_, allowed) in enumerate(masks):
        if i != 1:
            expected[i, torch.from_numpy(~allowed)] = NEG_INF
    if temperature:
        expected /= temperature
    joined = []
    for rank in range(tp):
        start, width, valid = vocab_shard(vocab, tp, rank)
        shard = torch.zeros(n, width)
        shard[:, :valid] = logits[:, start:start + valid]
        raw = shard.clone()
        sampler = ShardedSampler(None, start, valid, width, vocab, n)
        joined.append(sampler.processed(shard, rows, [[]] * n, [[]] * n).clone())
        assert torch.equal(shard, raw)
    assert torch.equal(torch.cat(joined, dim=1), expected)


def test_greedy_pick_is_the_best_allowed_id():
    vocab = 431
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    row, allowed = random_row(vocab, 11, density=0.05)
    rows = [RowSampling(seed=0, position=0, temperature=0.0, grammar_bitmask=row),
            RowSampling(seed=0, position=0, temperature=0.0)]
    got = ShardedSampler(None, 0, vocab, vocab, vocab, 2).sample(logits, rows, [[]] * 2,
                                                                 [[]] * 2).tolist()
    masked = logits[0].masked_fill(torch.from_numpy(~allowed), NEG_INF)
    assert got == [int(masked.argmax()), int(logits[1].argmax())]
    assert got[0] != int(logits[0].argmax()) or allowed[got[0]]
