"""64-bit sort keys: larger is better.

Unsigned layout (DESIGN.md): high 32 bits = order-preserving map of the reported FP32 value's
bits (-0.0 normalized to +0.0; positive: set the sign bit; negative: invert all bits), low 32
bits = 0xFFFFFFFF - token_id. Equal values therefore rank the smaller id first.

Stored in torch int64 with the top bit flipped (key XOR 2**63), so that signed comparisons,
``torch.sort`` and ``torch.topk`` order keys exactly as unsigned comparison would. The high
half as a signed int32 is then ``bits`` for non-negative floats and ``bits ^ 0x7FFFFFFF``
for negative ones.
"""

from __future__ import annotations

import torch

LOW_MASK = 0xFFFFFFFF
EMPTY_KEY = -(2**63)
"""A slot holding no candidate: below every real key (a real key's low half is never 0 with
high half at its minimum, because token ids are below 2**31)."""


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """FP32 values -> their int32 bit patterns (no rounding)."""
    return values.to(torch.float32).contiguous().view(torch.int32)


def bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns -> FP32 values (exact inverse of float_bits)."""
    return bits.to(torch.int32).contiguous().view(torch.float32)


def ordered_high(values: torch.Tensor) -> torch.Tensor:
    """FP32 -> int32 whose signed order equals the float order; -0.0 maps like +0.0."""
    v = values.to(torch.float32)
    v = torch.where(v == 0, torch.zeros_like(v), v)
    bits = float_bits(v)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def ordered_high_to_float(high: torch.Tensor) -> torch.Tensor:
    high = high.to(torch.int32)
    bits = torch.where(high < 0, high ^ 0x7FFFFFFF, high)
    return bits_to_float(bits)


def make_keys(values: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Sort keys (int64, signed storage) for FP32 reported values and global token ids."""
    high = ordered_high(values).to(torch.int64)
    low = LOW_MASK - token_ids.to(torch.int64)
    return (high << 32) | low


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    return LOW_MASK - (keys & LOW_MASK)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    return ordered_high_to_float((keys >> 32).to(torch.int32))


def keys_to_words(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys [..., n] -> int32 words [..., 2n] as (high, low) halves, bit-preserving."""
    high = (keys >> 32).to(torch.int32)
    low = (keys & LOW_MASK).to(torch.int64)
    low = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    return torch.stack((high, low), dim=-1).flatten(-2)


def words_to_keys(words: torch.Tensor) -> torch.Tensor:
    """Inverse of keys_to_words."""
    pairs = words.to(torch.int32).unflatten(-1, (-1, 2))
    high = pairs[..., 0].to(torch.int64)
    low = pairs[..., 1].to(torch.int64) & LOW_MASK
    return (high << 32) | low
