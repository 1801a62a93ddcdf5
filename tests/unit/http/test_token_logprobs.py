"""TokenLogprobs: two parallel lists that read as a sequence of TokenLogprob tuples."""

from __future__ import annotations

import math

import pytest

from helios_logprobs.runtime.outputs import GeneratedToken, TokenLogprob, TokenLogprobs


def test_reads_as_the_tuples_it_holds():
    pairs = TokenLogprobs([3, 1, 7], [-0.5, -1.25, -math.inf])
    assert len(pairs) == 3
    assert list(pairs) == [(3, -0.5), (1, -1.25), (7, -math.inf)]
    assert all(type(p) is TokenLogprob for p in pairs)
    assert pairs[1] == TokenLogprob(1, -1.25) and pairs[-1].logprob == -math.inf
    assert pairs[:2] == ((3, -0.5), (1, -1.25)) and isinstance(pairs[:2], TokenLogprobs)
    assert [alt.token_id for alt in pairs[1:]] == [1, 7]


def test_equals_any_sequence_of_the_same_pairs_either_way():
    pairs = TokenLogprobs([3, 1], [-0.5, -1.25])
    assert pairs == ((3, -0.5), (1, -1.25)) and ((3, -0.5), (1, -1.25)) == pairs
    assert pairs == [TokenLogprob(3, -0.5), TokenLogprob(1, -1.25)]
    assert pairs == TokenLogprobs([3, 1], [-0.5, -1.25])
    assert pairs != ((3, -0.5),) and pairs != ((1, -0.5), (3, -1.25))
    assert pairs != "ab" and TokenLogprobs([], []) == ()
    assert hash(pairs) == hash(((3, -0.5), (1, -1.25)))


def test_generated_tokens_compare_and_hash_through_their_alternatives():
    a = GeneratedToken(0, 5, -0.1, TokenLogprobs([5], [-0.1]))
    b = GeneratedToken(0, 5, -0.1, ((5, -0.1),))
    assert a == b and hash(a) == hash(b)


def test_of_keeps_a_token_logprobs_and_splits_pairs():
    pairs = TokenLogprobs([2], [-3.0])
    assert TokenLogprobs.of(pairs) is pairs
    split = TokenLogprobs.of(((4, -1.0), (9, -2.0)))
    assert (split.ids, split.values) == ([4, 9], [-1.0, -2.0])


def test_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="2 ids, 1 values"):
        TokenLogprobs([1, 2], [-1.0])
