/* Philox4x32-10 bits of CPU lanes, in compiled code (built with gumbel.c and sparse.c as one
   unit, kernels/noise/noise.c; kernels/noise/philox.py is the torch definition).

   Bits: m = (w0 << 20) | (w1 >> 12) of Philox4x32-10 with counter (id, position, 0, 0) and
   key (k0, k1), integer arithmetic only, so every path writes the same bits.

   Why the vector layout: _mm_mul_epu32 / _mm256_mul_epu32 multiply the low 32-bit half of
   each 64-bit slot, giving the full 64-bit product. Each state word lives in the low half of
   a 64-bit slot; its high half may hold garbage, because a product reads only the low half
   and every other use is an XOR whose garbage never reaches a low half. So a word costs one
   multiply, one shift and two XORs per round, with no masking; two registers per iteration
   (8 lanes) keep the multiplier busy. The vector loop needs AVX2 (checked at run time; GCC's
   generic vectors of the same loop measured 3.4x slower). With AVX-512F the same layout
   holds 8 lanes per register, and one ternary-logic instruction (0x96) does each three-way
   XOR: 6 instructions per 8 lanes and round instead of 16, four registers (32 lanes) in
   flight. The tail, x86 CPUs without AVX2 and other machines use the plain scalar loop,
   which is the Random123 definition. philox_vector_level caps the level (tests take every
   path on one machine). */
#include <math.h>
#include <stdint.h>

#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define W0 0x9E3779B9u
#define W1 0xBB67AE85u
#define BLOCK 128

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

#if defined(__x86_64__)
#include <immintrin.h>

/* 8 lanes per iteration; returns the lanes done. */
__attribute__((target("avx2")))
static int64_t avx2_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0, uint32_t k1,
                         int64_t *out)
{
    const __m256i m0 = _mm256_set1_epi64x(M0), m1 = _mm256_set1_epi64x(M1);
    const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFll);
    __m256i ka[10], kb[10];
    uint32_t a = k0, b = k1;
    for (int r = 0; r < 10; r++) {
        ka[r] = _mm256_set1_epi64x(a);
        kb[r] = _mm256_set1_epi64x(b);
        a += W0;
        b += W1;
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(ids + i));
        __m256i y0 = _mm256_loadu_si256((const __m256i *)(ids + i + 4));
        __m256i x1 = _mm256_set1_epi64x(pos), y1 = x1;
        __m256i x2 = _mm256_setzero_si256(), y2 = x2, x3 = x2, y3 = x2;
        for (int r = 0; r < 10; r++) {
            __m256i p0 = _mm256_mul_epu32(x0, m0), p1 = _mm256_mul_epu32(x2, m1);
            __m256i q0 = _mm256_mul_epu32(y0, m0), q1 = _mm256_mul_epu32(y2, m1);
            x0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), x1), ka[r]);
            x2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), x3), kb[r]);
            y0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(q1, 32), y1), ka[r]);
            y2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(q0, 32), y3), kb[r]);
            x1 = p1;
            x3 = p0;
            y1 = q1;
            y3 = q0;
        }
        x0 = _mm256_or_si256(_mm256_slli_epi64(_mm256_and_si256(x0, low), 20),
                             _mm256_srli_epi64(_mm256_and_si256(x1, low), 12));
        y0 = _mm256_or_si256(_mm256_slli_epi64(_mm256_and_si256(y0, low), 20),
                             _mm256_srli_epi64(_mm256_and_si256(y1, low), 12));
        _mm256_storeu_si256((__m256i *)(out + i), x0);
        _mm256_storeu_si256((__m256i *)(out + i + 4), y0);
    }
    return i;
}

/* 32 lanes per iteration; returns the lanes done. */
__attribute__((target("avx512f")))
static int64_t avx512_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0,
                           uint32_t k1, int64_t *out)
{
    const __m512i m0 = _mm512_set1_epi64(M0), m1 = _mm512_set1_epi64(M1);
    const __m512i low = _mm512_set1_epi64(0xFFFFFFFFll);
    __m512i ka[10], kb[10];
    uint32_t a = k0, b = k1;
    for (int r = 0; r < 10; r++) {
        ka[r] = _mm512_set1_epi64(a);
        kb[r] = _mm512_set1_epi64(b);
        a += W0;
        b += W1;
    }
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i x0[4], x1[4], x2[4], x3[4];
        for (int v = 0; v < 4; v++) {
            x0[v] = _mm512_loadu_si512((const void *)(ids + i + 8 * v));
            x1[v] = _mm512_set1_epi64(pos);
            x2[v] = _mm512_setzero_si512();
            x3[v] = x2[v];
        }
        for (int r = 0; r < 10; r++) {
            for (int v = 0; v < 4; v++) {
                __m512i p0 = _mm512_mul_epu32(x0[v], m0), p1 = _mm512_mul_epu32(x2[v], m1);
                x0[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), x1[v], ka[r], 0x96);
                x2[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), x3[v], kb[r], 0x96);
                x1[v] = p1;
                x3[v] = p0;
            }
        }
        for (int v = 0; v < 4; v++) {
            __m512i m = _mm512_or_si512(_mm512_slli_epi64(_mm512_and_si512(x0[v], low), 20),
                                        _mm512_srli_epi64(_mm512_and_si512(x1[v], low), 12));
            _mm512_storeu_si512((void *)(out + i + 8 * v), m);
        }
    }
    return i;
}

/* 0 scalar, 1 AVX2, 2 AVX-512F: the best this CPU has, or less (philox_vector_level). */
static int vector_level = -1; /* -1: not asked yet */

static int cpu_level(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}

static int has_avx2(void)
{
    if (vector_level < 0) vector_level = cpu_level();
    return vector_level >= 1;
}

/* Caps the vector level at `level` (at most what the CPU has); returns the level in use. */
int philox_vector_level(int level)
{
    const int best = cpu_level();
    vector_level = level < best ? (level < 0 ? 0 : level) : best;
    return vector_level;
}

static int64_t vector_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0,
                           uint32_t k1, int64_t *out)
{
    if (!has_avx2()) return 0;
    int64_t done = vector_level >= 2 ? avx512_bits(ids, n, pos, k0, k1, out) : 0;
    return done + avx2_bits(ids + done, n - done, pos, k0, k1, out + done);
}
#else
static int64_t vector_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0,
                           uint32_t k1, int64_t *out)
{
    (void)ids, (void)n, (void)pos, (void)k0, (void)k1, (void)out;
    return 0;
}

int philox_vector_level(int level)
{
    (void)level;
    return 0;
}
#endif

void philox_bits(const int64_t *ids, int64_t n, uint32_t pos, uint32_t k0, uint32_t k1,
                 int64_t *out)
{
    scalar_bits(ids, vector_bits(ids, n, pos, k0, k1, out), n, pos, k0, k1, out);
}

/* One key and position per lane (the sparse Gumbel-max path: lanes of several rows). The
   vector loops keep the per-lane keys in 64-bit slots like the state words: a 64-bit add of
   W0 gives the 32-bit sum in the low half (the carry goes to the high half, which nothing
   reads), so the key schedule is one add per round. */
#if defined(__x86_64__)
__attribute__((target("avx512f")))
static int64_t avx512_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                                 const int64_t *k1, int64_t n, int64_t *out)
{
    const __m512i m0 = _mm512_set1_epi64(M0), m1 = _mm512_set1_epi64(M1);
    const __m512i w0 = _mm512_set1_epi64(W0), w1 = _mm512_set1_epi64(W1);
    const __m512i low = _mm512_set1_epi64(0xFFFFFFFFll);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i x0[2], x1[2], x2[2], x3[2], a[2], b[2];
        for (int v = 0; v < 2; v++) {
            x0[v] = _mm512_loadu_si512((const void *)(ids + i + 8 * v));
            x1[v] = _mm512_loadu_si512((const void *)(pos + i + 8 * v));
            a[v] = _mm512_loadu_si512((const void *)(k0 + i + 8 * v));
            b[v] = _mm512_loadu_si512((const void *)(k1 + i + 8 * v));
            x2[v] = x3[v] = _mm512_setzero_si512();
        }
        for (int r = 0; r < 10; r++) {
            for (int v = 0; v < 2; v++) {
                __m512i p0 = _mm512_mul_epu32(x0[v], m0), p1 = _mm512_mul_epu32(x2[v], m1);
                x0[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p1, 32), x1[v], a[v], 0x96);
                x2[v] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), x3[v], b[v], 0x96);
                x1[v] = p1;
                x3[v] = p0;
                a[v] = _mm512_add_epi64(a[v], w0);
                b[v] = _mm512_add_epi64(b[v], w1);
            }
        }
        for (int v = 0; v < 2; v++) {
            __m512i m = _mm512_or_si512(_mm512_slli_epi64(_mm512_and_si512(x0[v], low), 20),
                                        _mm512_srli_epi64(_mm512_and_si512(x1[v], low), 12));
            _mm512_storeu_si512((void *)(out + i + 8 * v), m);
        }
    }
    return i;
}

__attribute__((target("avx2")))
static int64_t avx2_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                               const int64_t *k1, int64_t n, int64_t *out)
{
    const __m256i m0 = _mm256_set1_epi64x(M0), m1 = _mm256_set1_epi64x(M1);
    const __m256i w0 = _mm256_set1_epi64x(W0), w1 = _mm256_set1_epi64x(W1);
    const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFll);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(ids + i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(pos + i));
        __m256i a = _mm256_loadu_si256((const __m256i *)(k0 + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(k1 + i));
        __m256i x2 = _mm256_setzero_si256(), x3 = x2;
        for (int r = 0; r < 10; r++) {
            __m256i p0 = _mm256_mul_epu32(x0, m0), p1 = _mm256_mul_epu32(x2, m1);
            x0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), x1), a);
            x2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), x3), b);
            x1 = p1;
            x3 = p0;
            a = _mm256_add_epi64(a, w0);
            b = _mm256_add_epi64(b, w1);
        }
        x0 = _mm256_or_si256(_mm256_slli_epi64(_mm256_and_si256(x0, low), 20),
                             _mm256_srli_epi64(_mm256_and_si256(x1, low), 12));
        _mm256_storeu_si256((__m256i *)(out + i), x0);
    }
    return i;
}

static int64_t vector_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                                 const int64_t *k1, int64_t n, int64_t *out)
{
    if (!has_avx2()) return 0;
    int64_t done = vector_level >= 2 ? avx512_bits_lanes(ids, pos, k0, k1, n, out) : 0;
    return done + avx2_bits_lanes(ids + done, pos + done, k0 + done, k1 + done, n - done,
                                  out + done);
}
#else
static int64_t vector_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                                 const int64_t *k1, int64_t n, int64_t *out)
{
    (void)ids, (void)pos, (void)k0, (void)k1, (void)n, (void)out;
    return 0;
}
#endif

void philox_bits_lanes(const int64_t *ids, const int64_t *pos, const int64_t *k0,
                       const int64_t *k1, int64_t n, int64_t *out)
{
    for (int64_t i = vector_bits_lanes(ids, pos, k0, k1, n, out); i < n; i++)
        scalar_bits(ids + i, 0, 1, (uint32_t)pos[i], (uint32_t)k0[i], (uint32_t)k1[i], out + i);
}
