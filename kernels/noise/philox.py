"""Counter-based Philox4x32-10 noise for sampling, in pure torch int64 arithmetic.

Key = the request seed (64 bits: low word, high word); counter = (global token id, generated
position, 0, 0). The noise of a token therefore depends on (seed, position, global id) only:
not on the tensor-parallel degree, the shard layout, the batch or the device.

Two implementations of the same function:
- ``philox4x32``: all four output words, every 32-bit word in an int64 tensor holding a value
  in [0, 2**32), the 32x32-bit multiply split into 16-bit halves so that no intermediate
  product reaches 2**63 (the reference, checked against Random123's known answers).
- ``philox_bits`` (what ``philox_uniform`` and the sampler use): only the 52 bits a uniform
  keeps, with one int64 multiply per product. torch's int64 multiply wraps modulo 2**64, so
  the product's low 64 bits are exact: lo = its low word, hi = (product >> 32)'s low word.
  Words that only feed XORs keep whatever the arithmetic shift left in their high half; a
  word is masked to 32 bits only where it enters a multiply. The counter's constant words
  (position, 0, 0) make the first two rounds cheaper, and the last round needs only one
  product. About 75 elementwise int64 passes per lane instead of 190, over cache-sized
  blocks of lanes, in reused buffers. Tests compare both with a scalar reference.
  On CPU, with scalar position and key, the same bits come from compiled code
  (kernels/noise/philox_native.py) when a C compiler is available: about 12x faster at one
  thread with AVX2 (3.5x from the scalar loop without it), bit-identical.
- ``gumbel_bounds``: an FP32 upper bound of each lane's noise from its bits, so that the
  sampler evaluates the float64 noise only on lanes that can still win.
"""

from __future__ import annotations

import math
import threading

import torch

from helios_logprobs.kernels.noise.philox_native import (
    native_bits,
    native_bits_lanes,
    native_gumbel_bounds,
)

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10

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


BLOCK = 1 << 18
"""Lanes per block of philox_bits (seven int64 buffers of this size, kept per thread): fewer,
longer passes beat cache-sized blocks here, where each tensor op costs microseconds."""


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.cache: dict[tuple, list[torch.Tensor]] = {}


_BUFFERS = _Buffers()


def _buffers(n: int, device: torch.device) -> list[torch.Tensor]:
    key = (n, str(device))
    cache = _BUFFERS.cache
    bufs = cache.get(key)
    if bufs is None:
        if len(cache) > 8:
            cache.clear()
        bufs = cache[key] = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(7)]
    return bufs


def _xor_into(t: torch.Tensor, *terms: IntLike) -> torch.Tensor:
    """t ^= every term (Python ints folded into one)."""
    scalar = 0
    for v in terms:
        if isinstance(v, torch.Tensor):
            t.bitwise_xor_(v)
        else:
            scalar ^= int(v)
    if scalar:
        t.bitwise_xor_(scalar)
    return t


def _philox_bits_block(c0: torch.Tensor, c1: IntLike, k0: IntLike, k1: IntLike,
                       out: torch.Tensor) -> None:
    """out = (w0 << 20) | (w1 >> 12) for counters (c0, c1, 0, 0); c0 clean int64, c1/k0/k1
    clean ints or clean int64 tensors shaped like c0."""
    a0, a2, *free = _buffers(c0.numel(), c0.device)
    a0, a2 = a0[: c0.numel()], a2[: c0.numel()]
    free = [t[: c0.numel()] for t in free]
    keys = [((k0 + r * PHILOX_W0) & MASK32, (k1 + r * PHILOX_W1) & MASK32) for r in range(ROUNDS)]
    # Round 0, x2 = x3 = 0: x0' = c1 ^ k0 (p1 = 0), x1' = 0, x2' = hi(M0 c0) ^ k1,
    # x3' = lo(M0 c0).
    p0 = free.pop()
    torch.mul(c0, PHILOX_M0, out=p0)
    x0 = c1 ^ keys[0][0]
    _xor_into(torch.bitwise_right_shift(p0, 32, out=a2), keys[0][1]).bitwise_and_(MASK32)
    # Round 1, x1 = 0: x0'' = hi(M1 x2') ^ k0, x1'' = lo(M1 x2'), x2'' = hi(M0 x0') ^ x3' ^ k1,
    # x3'' = lo(M0 x0').
    p1 = free.pop()
    torch.mul(a2, PHILOX_M1, out=p1)
    _xor_into(torch.bitwise_right_shift(p1, 32, out=a0), keys[1][0]).bitwise_and_(MASK32)
    if isinstance(x0, torch.Tensor):
        q0 = free.pop()
        torch.mul(x0, PHILOX_M0, out=q0)
        hi0, x3 = q0 >> 32, q0
    else:
        hi0, x3 = (PHILOX_M0 * x0) >> 32, (PHILOX_M0 * x0) & MASK32
    if isinstance(hi0, torch.Tensor) or isinstance(keys[1][1], torch.Tensor):
        torch.bitwise_xor(p0, hi0, out=a2)  # x3' = lo(p0): only its low word matters
        _xor_into(a2, keys[1][1])
    else:
        torch.bitwise_xor(p0, hi0 ^ keys[1][1], out=a2)
    a2.bitwise_and_(MASK32)
    free.append(p0)
    x1 = p1
    # Rounds 2-8.
    for r in range(2, ROUNDS - 1):
        n0, n1 = free.pop(), free.pop()
        torch.mul(a0, PHILOX_M0, out=n0)
        torch.mul(a2, PHILOX_M1, out=n1)
        _xor_into(torch.bitwise_right_shift(n1, 32, out=a0), x1, keys[r][0])
        a0.bitwise_and_(MASK32)
        _xor_into(torch.bitwise_right_shift(n0, 32, out=a2), x3, keys[r][1])
        a2.bitwise_and_(MASK32)
        free += [t for t in (x1, x3) if isinstance(t, torch.Tensor)]
        x1, x3 = n1, n0
    # Round 9: only w0 = hi(M1 x2) ^ x1 ^ k0 and w1 = lo(M1 x2).
    n1 = free.pop()
    torch.mul(a2, PHILOX_M1, out=n1)
    w0 = _xor_into(torch.bitwise_right_shift(n1, 32, out=a0), x1, keys[ROUNDS - 1][0])
    w0.bitwise_and_(MASK32).bitwise_left_shift_(UNIFORM_BITS - 32)
    n1.bitwise_right_shift_(64 - UNIFORM_BITS).bitwise_and_((1 << (UNIFORM_BITS - 32)) - 1)
    torch.bitwise_or(w0, n1, out=out)


def philox_bits(token_ids: torch.Tensor, position: IntLike, k0: IntLike, k1: IntLike,
                out: torch.Tensor | None = None, *, clean: bool = False) -> torch.Tensor:
    """int64 m = (w0 << 20) | (w1 >> 12), the 52 bits of a uniform, per token id of a 1-D
    tensor; position and the key words k0, k1 are ints or int64 tensors shaped like it
    (all taken modulo 2**32). clean: the ids are already int64 in [0, 2**32)."""
    n = token_ids.numel()
    dev = token_ids.device
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=dev)
    keys = (position, k0, k1)
    if not any(isinstance(v, torch.Tensor) for v in keys):
        if native_bits(token_ids, int(position), int(k0), int(k1), out):
            return out
    elif all(isinstance(v, torch.Tensor) for v in keys) and native_bits_lanes(
            token_ids, position, k0, k1, out):
        return out
    c0 = token_ids if clean else token_ids.to(torch.int64) & MASK32
    args = [v & MASK32 if isinstance(v, torch.Tensor) else int(v) & MASK32
            for v in (position, k0, k1)]
    args = [v.to(device=dev, dtype=torch.int64) if isinstance(v, torch.Tensor) else v
            for v in args]
    for start in range(0, n, BLOCK):
        end = min(n, start + BLOCK)
        part = [v[start:end] if isinstance(v, torch.Tensor) else v for v in args]
        _philox_bits_block(c0[start:end], *part, out[start:end])
    return out


def philox_uniform(seed: IntLike, position: IntLike, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per global token id; seed/position broadcast with ids.

    Uses output words 0 and 1: m = (w0 << 20) | (w1 >> 12), u = (m + 0.5) / 2**52.
    """
    k0, k1 = seed_words(seed)
    args = [token_ids, position, k0, k1]
    shape = torch.broadcast_shapes(*(v.shape for v in args if isinstance(v, torch.Tensor)))
    flat = [v.expand(shape).reshape(-1) if isinstance(v, torch.Tensor) else v for v in args]
    m = philox_bits(flat[0], flat[1], flat[2], flat[3])
    return m.to(torch.float64).add_(0.5).mul_(2.0**-UNIFORM_BITS).view(shape)


def uniform_of(m: torch.Tensor) -> torch.Tensor:
    """float64 (m + 0.5) / 2**52, exactly as philox_uniform turns bits into uniforms."""
    return m.to(torch.float64).add_(0.5).mul_(2.0**-UNIFORM_BITS)


def gumbel_noise(seed: IntLike, position: IntLike, token_ids: torch.Tensor) -> torch.Tensor:
    """float64 standard Gumbel noise -log(-log(u)) for each global token id."""
    return philox_uniform(seed, position, token_ids).log_().neg_().log_().neg_()


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


BOUND_SCALE = _f32(math.log(2.0) * 2.0**-23)
BOUND_OFFSET = _f32(158 * math.log(2.0) + 1e-3)


def gumbel_bounds(m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 upper bounds of the noise -log(-log(u)) of the bits m (int64 [n]), u = (m + 0.5)
    / 2**52, as gumbel_noise computes it in float64: BOUND_OFFSET - BOUND_SCALE * bits(h),
    h = (2**52 - 1 - m) >> 21 in [0, 2**31) as FP32, bits(h) its int32 pattern.

    Why it bounds: with d = 1 - u, -log(u) >= d, so the noise is <= -log(d); and d >= h 2**-31,
    so for h >= 1 the noise is <= ln 2 (31 - log2 h). Reading FP32(h) = 2**e (1 + f) as
    bits / 2**23 - 127 = e + f <= log2 (Mitchell's log, below log2 since 1 + f <= 2**f)
    gives ln 2 (158 - bits / 2**23). For h = 0 (bits 0) that is 109.5 > GUMBEL_MAX. The
    1e-3 in BOUND_OFFSET covers every FP32 rounding here (each below 2e-5). The bound is tight
    (within ln(1 + 1/h) + 0.06) exactly where the noise is large, which is what pruning needs.
    """
    if out is None:
        out = torch.empty(m.shape, dtype=torch.float32, device=m.device)
    if native_gumbel_bounds(m, BOUND_OFFSET, BOUND_SCALE, out):
        return out
    h = torch.bitwise_xor(m, 2**UNIFORM_BITS - 1).bitwise_right_shift_(21).to(torch.int32)
    bits = h.to(torch.float32).view(torch.int32)
    return out.copy_(bits).mul_(BOUND_SCALE).neg_().add_(BOUND_OFFSET)
