"""Philox bits for one CPU row in compiled code, when a C compiler is at hand.

``native_bits(ids, position, k0, k1, out)`` writes the same int64 m = (w0 << 20) | (w1 >> 12)
as ``kernels.noise.philox.philox_bits`` (integer arithmetic only, so the bits are identical, not
merely close). The C source below is compiled once per source hash with the system C
compiler (``$CC``, else ``cc``) into a per-user cache directory and loaded with ctypes. Without
a compiler, on failure, off x86/aarch64 CPUs, or with ``HELIOS_NATIVE_PHILOX=0``,
``available()`` is False and callers keep the torch path. ``native_gumbel_bounds`` is the
same for kernels.noise.philox.gumbel_bounds (float32, rounded as the torch path rounds it). Tests
compare both paths.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kernels.native import built_once, load_library

# Why this layout: with SSE2 (baseline x86-64), _mm_mul_epu32 multiplies the low 32-bit half
# of each 64-bit slot, giving the full 64-bit product. Each state word lives in the low half
# of a 64-bit slot; its high half may hold garbage, because a product reads only the low
# half and every other use is an XOR whose garbage never reaches a low half. So a word costs
# one multiply, one shift and two XORs per round, with no masking; two registers per
# iteration (four lanes) keep the multiplier busy. The tail and non-x86 builds use the plain
# scalar loop, which is the Random123 definition.
_SOURCE = r"""
#include <stdint.h>
#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define W0 0x9E3779B9u
#define W1 0xBB67AE85u

static void scalar_bits(const int64_t *ids, int64_t start, int64_t n, uint32_t pos,
                        uint32_t k0, uint32_t k1, int64_t *out)
{
    for (int64_t i = start; i < n; i++) {
        uint32_t x0 = (uint32_t)ids[i], x1 = pos, x2 = 0, x3 = 0, a = k0, b = k1;
        for (int r = 0; r < 10; r++) {
            uint64_t p0 = (uint64_t)M0 * x0, p1 = (uint64_t)M1 * x2;
            x0 = (uint32_t)(p1 >> 32) ^ x1 ^ a;
            x1 = (uint32_t)p1;
            x2 = (uint32_t)(p0 >> 32) ^ x3 ^ b;
            x3 = (uint32_t)p0;
            a += W0;
            b += W1;
        }
        out[i] = ((int64_t)x0 << 20) | (int64_t)(x1 >> 12);
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
void philox_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0, uint32_t k1,
                 int64_t *out)
{
    const __m128i m0 = _mm_set1_epi64x(M0), m1 = _mm_set1_epi64x(M1);
    const __m128i low = _mm_set1_epi64x(0xFFFFFFFFll);
    __m128i ka[10], kb[10];
    uint32_t a = k0, b = k1;
    for (int r = 0; r < 10; r++) {
        ka[r] = _mm_set1_epi64x(a);
        kb[r] = _mm_set1_epi64x(b);
        a += W0;
        b += W1;
    }
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(ids + i));
        __m128i y0 = _mm_loadu_si128((const __m128i *)(ids + i + 2));
        __m128i x1 = _mm_set1_epi64x(pos), y1 = x1;
        __m128i x2 = _mm_setzero_si128(), y2 = x2, x3 = x2, y3 = x2;
        for (int r = 0; r < 10; r++) {
            __m128i p0 = _mm_mul_epu32(x0, m0), p1 = _mm_mul_epu32(x2, m1);
            __m128i q0 = _mm_mul_epu32(y0, m0), q1 = _mm_mul_epu32(y2, m1);
            x0 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi64(p1, 32), x1), ka[r]);
            x2 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi64(p0, 32), x3), kb[r]);
            y0 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi64(q1, 32), y1), ka[r]);
            y2 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi64(q0, 32), y3), kb[r]);
            x1 = p1;
            x3 = p0;
            y1 = q1;
            y3 = q0;
        }
        x0 = _mm_or_si128(_mm_slli_epi64(_mm_and_si128(x0, low), 20),
                          _mm_srli_epi64(_mm_and_si128(x1, low), 12));
        y0 = _mm_or_si128(_mm_slli_epi64(_mm_and_si128(y0, low), 20),
                          _mm_srli_epi64(_mm_and_si128(y1, low), 12));
        _mm_storeu_si128((__m128i *)(out + i), x0);
        _mm_storeu_si128((__m128i *)(out + i + 2), y0);
    }
    scalar_bits(ids, i, n, pos, k0, k1, out);
}
#else
void philox_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0, uint32_t k1,
                 int64_t *out)
{
    scalar_bits(ids, 0, n, pos, k0, k1, out);
}
#endif

/* One key and position per lane (the sparse Gumbel-max path: lanes of several rows). */
void philox_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                       const int64_t *k1, int64_t n, int64_t *out)
{
    for (int64_t i = 0; i < n; i++)
        scalar_bits(ids + i, 0, 1, (uint32_t)pos[i], (uint32_t)k0[i], (uint32_t)k1[i], out + i);
}

void gumbel_bounds(const int64_t *m, int64_t n, float c0, float c1, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        union { float f; int32_t b; } h;
        h.f = (float)(int32_t)((uint64_t)(m[i] ^ 0xFFFFFFFFFFFFFll) >> 21);
        out[i] = c0 - c1 * (float)h.b;
    }
}
"""

_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off")
_ENV_SWITCH = "HELIOS_NATIVE_PHILOX"
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _build() -> ctypes.CDLL | None:
    lib = load_library("philox", _SOURCE, _FLAGS, _ENV_SWITCH)
    if lib is None:
        return None
    fn = lib.philox_bits
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32,
                   ctypes.c_uint32, ctypes.c_void_p]
    fn = lib.philox_bits_lanes
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
    fn = lib.gumbel_bounds
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                   ctypes.c_void_p]
    return lib


def _lib() -> ctypes.CDLL | None:
    return built_once(_STATE, _LOCK, _build)


def available() -> bool:
    return _lib() is not None


def native_bits(token_ids: torch.Tensor, position: int, k0: int, k1: int,
                out: torch.Tensor) -> bool:
    """Fill out (int64, like token_ids) with philox_bits' m; False when not applicable (not
    CPU, not contiguous int64, or no native library): then nothing is written."""
    if (token_ids.device.type != "cpu" or out.device.type != "cpu"
            or token_ids.dtype != torch.int64 or out.dtype != torch.int64
            or not token_ids.is_contiguous() or not out.is_contiguous()
            or out.numel() != token_ids.numel()):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.philox_bits(token_ids.data_ptr(), token_ids.numel(), position & 0xFFFFFFFF,
                    k0 & 0xFFFFFFFF, k1 & 0xFFFFFFFF, out.data_ptr())
    return True


def native_bits_lanes(token_ids: torch.Tensor, position: torch.Tensor, k0: torch.Tensor,
                      k1: torch.Tensor, out: torch.Tensor) -> bool:
    """native_bits with one position and key pair per lane (int64 tensors shaped like
    token_ids, taken modulo 2**32); False when not applicable (nothing written)."""
    tensors = (token_ids, position, k0, k1, out)
    n = token_ids.numel()
    if not all(t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous()
               and t.numel() == n for t in tensors):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.philox_bits_lanes(*(t.data_ptr() for t in tensors[:4]), n, out.data_ptr())
    return True


def native_gumbel_bounds(m: torch.Tensor, c0: float, c1: float, out: torch.Tensor) -> bool:
    """out = c0 - c1 * float32 bits of float32(int32((m ^ (2**52 - 1)) >> 21)), as
    kernels.noise.philox.gumbel_bounds computes it; False when not applicable (nothing written)."""
    if (m.device.type != "cpu" or out.device.type != "cpu" or m.dtype != torch.int64
            or out.dtype != torch.float32 or not m.is_contiguous() or not out.is_contiguous()
            or out.numel() != m.numel()):
        return False
    lib = _lib()
    if lib is None:
        return False
    lib.gumbel_bounds(m.data_ptr(), m.numel(), c0, c1, out.data_ptr())
    return True
