"""Entropy of a vocabulary-sharded distribution from one more word of exchange 1.

For a row x over the full vocabulary, p = softmax(x), with lse = M + log S:

    H = -sum p (x - lse) = log S - sum_j e^(x_j - M) (x_j - M) / S

Each shard already sends (m_r, s_r) = (its max, sum e^(x - m_r)) in exchange 1; word 2
(``ENTROPY_WORD``) adds t_r = sum e^(x - m_r) (x - m_r) over its valid lanes, all FP32.
With w_r = e^(m_r - M): S = sum w_r s_r and sum e^(x - M)(x - M) = sum w_r (t_r + (m_r - M)
s_r), combined in rank order so that every rank gets bit-identical values. Terms are taken
relative to the shard max, so no e^x overflows and the products stay near the row's scale;
a lane at -inf (masked by a filter) weighs exactly 0 (its term is 0, never 0 x -inf),
padded lanes are never read. A row with a +inf or NaN lane has no finite distribution and
reports NaN, as its logprobs do (the statistics launches' max is then +inf or NaN). Work is
per row tile of at most ``TILE_LANES`` lanes: no [rows, vocabulary] FP32 copy.

Every row of the buffer is computed and the request's flags gate the writes (one
``torch.where`` per output): fixed shapes and no host read of a value, so the path can be
captured in a graph; a row's value does not depend on which other rows are flagged.
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import ENTROPY_WORD
from helios_logprobs.kernels.sortkeys import bits_to_float, float_bits

TILE_LANES = 8192
NEG_INF = float("-inf")


def shard_maxima(logits: torch.Tensor, local_valid: int) -> torch.Tensor:
    """FP32 [rows] shard max of the valid lanes (NaN if one is NaN; -inf without lanes)."""
    big = torch.full((logits.shape[0],), NEG_INF, dtype=torch.float32, device=logits.device)
    for t0 in range(0, local_valid, TILE_LANES):
        tile = logits[:, t0 : min(t0 + TILE_LANES, local_valid)].to(torch.float32)
        big = torch.maximum(big, tile.amax(1))
    return big


def shard_terms(
    logits: torch.Tensor, local_valid: int, big: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 (mass, t) [rows] of the valid lanes relative to ``big`` (the shard max)."""
    shift = torch.where(torch.isfinite(big), big, torch.zeros_like(big)).unsqueeze(1)
    mass = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    terms = torch.zeros_like(mass)
    for t0 in range(0, local_valid, TILE_LANES):
        # (copy=True: the in-place steps never touch the logits, FP32 ones included)
        d = logits[:, t0 : min(t0 + TILE_LANES, local_valid)].to(torch.float32, copy=True)
        d.sub_(shift)
        w = torch.exp(d)
        mass += w.sum(1)
        # A -inf lane has w = 0 and w x d = NaN: it adds exactly 0.
        terms += w.mul_(d).nan_to_num_(nan=0.0, neginf=0.0).sum(1)
    bad = ~torch.isfinite(big) & (big != NEG_INF)
    return mass, torch.where(bad, torch.full_like(terms, float("nan")), terms)


def _gated(flags: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` where the row's flag is set, else ``old`` (one fixed-shape select)."""
    return torch.where(flags != 0, new, old)


def write_entropy_word(
    logits: torch.Tensor, flags: torch.Tensor, local_valid: int, e1_send: torch.Tensor
) -> None:
    """Word 2 of every flagged exchange-1 row: t_r relative to word 0 (the shard max the
    statistics launch wrote). Every row is computed (fixed shapes, no host read: capturable);
    unflagged rows keep their word."""
    big = bits_to_float(e1_send[:, 0])
    _, terms = shard_terms(logits, local_valid, big)
    word = e1_send[:, ENTROPY_WORD]
    e1_send[:, ENTROPY_WORD] = _gated(flags, float_bits(terms), word)


def combine_entropy(e1_all: torch.Tensor) -> torch.Tensor:
    """Exchange 1 [world, rows, >=3] -> FP32 entropy [rows] in nats (NaN when non-finite)."""
    big_all = bits_to_float(e1_all[..., 0])
    mass_all = bits_to_float(e1_all[..., 1])
    terms_all = bits_to_float(e1_all[..., ENTROPY_WORD])
    big = big_all.amax(0)
    shift = torch.where(big == NEG_INF, torch.zeros_like(big), big)
    mass = torch.zeros_like(big)
    terms = torch.zeros_like(big)
    for r in range(e1_all.shape[0]):
        weight = torch.exp(big_all[r] - shift)  # 0 for an empty shard (max -inf)
        live = mass_all[r] > 0
        offset = torch.where(live, (big_all[r] - shift) * mass_all[r], 0.0)
        mass = mass + mass_all[r] * weight
        terms = terms + torch.where(live, weight * (terms_all[r] + offset), 0.0)
    entropy = (torch.log(mass) - terms / mass).clamp_(min=0.0)
    return torch.where(torch.isfinite(entropy), entropy, torch.full_like(entropy, float("nan")))


def combine_flagged(e1_all: torch.Tensor, flags: torch.Tensor, entropy_out: torch.Tensor
                    ) -> None:
    """The flagged rows' entropy from exchange 1 [world, rows, >=3] into ``entropy_out``
    (FP32 [rows]); every row is combined, unflagged rows keep their value."""
    entropy_out.copy_(_gated(flags, combine_entropy(e1_all), entropy_out))


def whole_entropy(logits: torch.Tensor, local_valid: int) -> torch.Tensor:
    """One rank: FP32 entropy [rows] of every row from its own statistics (no exchange)."""
    big = shard_maxima(logits, local_valid)
    mass, terms = shard_terms(logits, local_valid, big)
    words = torch.stack((float_bits(big), float_bits(mass), float_bits(terms)), dim=1)
    return combine_entropy(words.unsqueeze(0))


def whole_flagged(logits: torch.Tensor, flags: torch.Tensor, local_valid: int,
                  entropy_out: torch.Tensor) -> None:
    """One rank: the flagged rows' entropy into ``entropy_out``; unflagged rows keep theirs."""
    entropy_out.copy_(_gated(flags, whole_entropy(logits, local_valid), entropy_out))
