"""Counter-based Philox4x32-10 noise for sampling, in pure torch int64 arithmetic.

Key = the request seed (64 bits: low word, high word); counter = (global token id, generated
position, 0, 0). The noise of a token therefore depends on (seed, position, global id) only:
not on the tensor-parallel degree, the shard layout, the batch or the device.

Every 32-bit word lives in an int64 tensor holding a value in [0, 2**32). The 32x32-bit
multiply is split into two 16-bit halves so that no intermediate product reaches 2**63.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10
CHUNK = 1 << 16

UNIFORM_BITS = 52
"""Uniforms are (m + 0.5) / 2**52 with m < 2**52: exact in float64, strictly inside (0, 1)."""

GUMBEL_MAX = -math.log(-math.log1p(-(2.0**-UNIFORM_BITS) / 2))
GUMBEL_MIN = -math.log(-math.log(2.0**-UNIFORM_BITS / 2))
GUMBEL_SPAN = math.ceil(GUMBEL_MAX - GUMBEL_MIN) + 1.0
"""Every noise value lies in [GUMBEL_MIN, GUMBEL_MAX]; a lane whose score plus GUMBEL_SPAN
stays below another lane's score can never win a Gumbel-max (used to skip noise work)."""

IntLike = int | torch.Tensor


def _word(value: IntLike, shape: torch.Size, device: torch.device | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=torch.int64) & MASK32
        return value.expand(shape).contiguous()
    return torch.full(shape, int(value) & MASK32, dtype=torch.int64, device=device)


def _mulhilo(
    m: int,
    x: torch.Tensor,
    hi: torch.Tensor,
    lo: torch.Tensor,
    p_lo: torch.Tensor,
    p_hi: torch.Tensor,
) -> None:
    # (hi, lo) = 32-bit halves of m * x, written in place. The constant is split into 16-bit
    # halves: p_lo = x * (m & 0xFFFF) and p_hi = x * (m >> 16) are < 2**48, so nothing
    # overflows int64; m * x = p_hi * 2**16 + p_lo gives hi = (p_hi + (p_lo >> 16)) >> 16
    # and lo = (p_lo + ((p_hi & 0xFFFF) << 16)) mod 2**32.
    torch.mul(x, m & 0xFFFF, out=p_lo)
    torch.mul(x, m >> 16, out=p_hi)
    torch.bitwise_right_shift(p_lo, 16, out=hi).add_(p_hi).bitwise_right_shift_(16)
    torch.bitwise_and(p_hi, 0xFFFF, out=lo).bitwise_left_shift_(16).add_(p_lo)
    lo.bitwise_and_(MASK32)


def philox4x32(
    c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike, k0: IntLike, k1: IntLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of counter (c0..c3) under key (k0, k1); arguments broadcast together.

    Inputs are taken modulo 2**32; the four output words are int64 tensors in [0, 2**32).
    """
    args = (c0, c1, c2, c3, k0, k1)
    tensors = [v for v in args if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else None
    shape = torch.broadcast_shapes(*(v.shape for v in tensors)) if tensors else torch.Size()
    x0, x1, x2, x3 = (_word(v, shape, device) for v in (c0, c1, c2, c3))
    key0, key1 = (v & MASK32 if isinstance(v, int) else _word(v, shape, device) for v in (k0, k1))
    hi0, lo0, hi1, lo1, p_lo, p_hi = (torch.empty_like(x0) for _ in range(6))
    for r in range(ROUNDS):
        if r:
            key0 = (key0 + PHILOX_W0) & MASK32
            key1 = (key1 + PHILOX_W1) & MASK32
        _mulhilo(PHILOX_M0, x0, hi0, lo0, p_lo, p_hi)
        _mulhilo(PHILOX_M1, x2, hi1, lo1, p_lo, p_hi)
        hi1.bitwise_xor_(x1).bitwise_xor_(key0)
        hi0.bitwise_xor_(x3).bitwise_xor_(key1)
        # new state (hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0); old buffers are reused.
        x0, x1, x2, x3, hi1, lo1, hi0, lo0 = hi1, lo1, hi0, lo0, x0, x1, x2, x3
    return x0, x1, x2, x3


def seed_words(seed: IntLike) -> tuple[IntLike, IntLike]:
    """Key words of a 64-bit seed (Python ints are taken modulo 2**64)."""
    if isinstance(seed, torch.Tensor):
        seed = seed.to(torch.int64)
        return seed & MASK32, (seed >> 32) & MASK32
    seed = int(seed) & ((1 << 64) - 1)
    return seed & MASK32, seed >> 32


def philox_uniform(seed: IntLike, position: IntLike, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per global token id; seed/position broadcast with ids.

    Uses output words 0 and 1: m = (w0 << 20) | (w1 >> 12), u = (m + 0.5) / 2**52.
    """
    k0, k1 = seed_words(seed)
    args = [token_ids, position, k0, k1]
    shape = torch.broadcast_shapes(*(v.shape for v in args if isinstance(v, torch.Tensor)))
    flat = [v.expand(shape).reshape(-1) if isinstance(v, torch.Tensor) else v for v in args]
    out = torch.empty(shape.numel(), dtype=torch.float64, device=token_ids.device)
    # Chunks keep the ~16 live int64 temporaries cache-sized (about 2x faster on CPU).
    for start in range(0, out.numel(), CHUNK):
        part = [v[start : start + CHUNK] if isinstance(v, torch.Tensor) else v for v in flat]
        w0, w1, _, _ = philox4x32(part[0], part[1], 0, 0, part[2], part[3])
        m = w0.bitwise_left_shift_(UNIFORM_BITS - 32).bitwise_or_(w1 >> (64 - UNIFORM_BITS))
        out[start : start + CHUNK] = m.to(torch.float64).add_(0.5).mul_(2.0**-UNIFORM_BITS)
    return out.view(shape)


def gumbel_noise(seed: IntLike, position: IntLike, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 standard Gumbel noise -log(-log(u)) for each global token id."""
    return philox_uniform(seed, position, token_ids).log_().neg_().log_().neg_()
