"""Sampling parameters at the edges of float32: the sampler still picks an allowed vocabulary
id, the one exact arithmetic on the penalized logits would pick.

vLLM accepts any repetition penalty > 0 and any finite temperature, frequency penalty and
bias on its offline API. In float32 a penalty of 5e-324 rounds to 0 and one of 1e300 to inf,
and vLLM's `where(x > 0, x / p, x * p)` then turns a masked lane's -inf (times 0) or a zero
logit (times inf) into NaN, and an allowed negative logit (times inf) into -inf, leaving no
lane to pick. Here each factor is clamped to float32's positive finite range and a finite
lane saturates at +-LOGIT_LIMIT instead of overflowing: a masked lane stays masked, the only
-inf lanes are masked ones, a positive seen logit divided by a penalty of ~0 becomes the
largest value (equal ones tie: the smallest id wins), and a zero logit stays 0. The expected
tokens below come from exact arithmetic, not from the sampler.
"""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

VOCAB = 1031
PROMPT = [0, 5, 9, 14]
OUTPUT = [9, 21]
SEEN = sorted(set(PROMPT + OUTPUT))


def sample(logits: torch.Tensor, row: RowSampling) -> int:
    sampler = ShardedSampler(None, 0, VOCAB, VOCAB, VOCAB, 1)
    return int(sampler.sample(logits.unsqueeze(0), [row], [PROMPT], [OUTPUT])[0])


def logits_with(values: dict[int, float]) -> torch.Tensor:
    x = torch.randn(VOCAB, generator=torch.Generator().manual_seed(11))
    for lane, value in values.items():
        x[lane] = value
    return x


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-45])
def test_a_vanishing_repetition_penalty_keeps_masked_lanes_masked(penalty, temperature):
    """Allowed: one seen lane with a negative logit (-> -0.0 or -tiny) and two unseen lanes
    below it. The masked seen lanes (5, 9, 14, 21) must not come back as NaN winners."""
    x = logits_with({0: -2.0, 5: 3.0, 9: 4.0, 300: -5.0, 301: -6.0})
    row = RowSampling(seed=3, position=0, temperature=temperature, repetition_penalty=penalty,
                      allowed_token_ids=(0, 300, 301))
    got = sample(x, row)
    assert got in (0, 300, 301)
    if temperature == 0.0:
        assert got == 0  # (-2 x ~0 = -0.0 beats -5 and -6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_vanishing_penalty_makes_positive_seen_lanes_certain(temperature):
    """Positive seen logits divided by ~0 are +inf: the smallest such id wins, seeded or not."""
    x = logits_with({5: 0.25, 9: 8.0, 14: -1.0, 21: 0.5})
    row = RowSampling(seed=5, position=2, temperature=temperature, repetition_penalty=5e-324)
    assert sample(x, row) == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("penalty", [1e300, 3.5e38, 1e39])
def test_an_infinite_repetition_penalty_keeps_a_zero_logit(penalty, temperature):
    """0 x inf would be NaN: the one allowed seen lane holds 0.0 and must be picked over the
    allowed unseen lane at -50 (a negative seen logit times ~inf is -inf)."""
    x = logits_with({9: 0.0, 14: -1.0, 600: -50.0})
    row = RowSampling(seed=1, position=0, temperature=temperature, repetition_penalty=penalty,
                      allowed_token_ids=(9, 14, 600))
    assert sample(x, row) == 9


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_huge_bias_and_penalties_do_not_revive_masked_lanes(temperature):
    """A bias of 1e308 (inf in float32) on a masked lane would give -inf + inf = NaN. Seen lane
    9 is 2 / 5e-324 - 2e308 (hugely negative), 701 is 0.5 - 1e308: 700 (1.0) is the only
    allowed lane left near zero."""
    x = logits_with({9: 2.0, 700: 1.0, 701: 0.5})
    row = RowSampling(seed=8, position=1, temperature=temperature, repetition_penalty=5e-324,
                      frequency_penalty=1e308, presence_penalty=1e308,
                      logit_bias=((5, 1e308), (701, -1e308)), allowed_token_ids=(9, 700, 701))
    assert sample(x, row) == 700


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-5])
@pytest.mark.parametrize("penalty", [1e300, 1e39, 3e38])
def test_an_allowed_negative_logit_under_a_huge_penalty_is_still_picked(penalty, temperature):
    """-3 x 1e300 overflows to -inf in float32, which would leave every lane -inf (the row's
    pick then lane 0, outside the allowed set). It saturates instead: the one allowed lane is
    picked at every temperature, the smallest sampling one included. Found by the server's
    property test (prompt [0], allowed [51], repetition_penalty 1e300)."""
    x = logits_with({9: -3.0})
    row = RowSampling(seed=4, position=1, temperature=temperature, repetition_penalty=penalty,
                      allowed_token_ids=(9,))
    assert sample(x, row) == 9


def test_an_enormous_temperature_keeps_an_infinite_lane_certain():
    """x / 1e300 (inf in float32) would be +inf / inf = NaN on a raw +inf lane; divided by the
    largest float32 instead, it stays +inf and is picked."""
    x = logits_with({5: float("inf")})
    row = RowSampling(seed=2, position=0, temperature=1e300, repetition_penalty=5e-324,
                      allowed_token_ids=(5, 800))
    assert sample(x, row) == 5


def test_an_enormous_temperature_flattens_finite_lanes():
    """A finite lane, however large the vanishing penalty made it, is ~0 after dividing by
    1e300: both allowed ids are drawn over a few seeds."""
    x = logits_with({5: 1.0})
    picks = {sample(x, RowSampling(seed=seed, position=0, temperature=1e300,
                                   repetition_penalty=5e-324, allowed_token_ids=(5, 800)))
             for seed in range(16)}
    assert picks == {5, 800}
