/* torch's FP32 exp, lane for lane, in AVX-512 (reduction.c puts this file before compiled.c).

   Why: torch.exp on FP32 calls MKL's vmsExp. On an AMD CPU MKL does not take its AVX2 or
   AVX-512 kernels; it runs the SSE kernel mkl_vml_kernel_sExp_EXHAynn (4 lanes per
   instruction, ~0.9 ns a lane), the largest share of the reduction's launch 1 at 151,936
   ids. MKL's own AVX-512 kernel (Z0HAynn) rounds 1.6% of lanes differently, so it is not a
   substitute. This file repeats the EX kernel's arithmetic instead, 16 lanes per instruction:
   every step is one IEEE FP32 operation (built with -ffp-contract=off, so no FMA) or an
   integer one, so the values are the same words. exp_mismatches() compares the two over any
   range of the 2^32 inputs (tests/unit/kernels/test_exp_lanes.py sweeps all of them), and
   compiled.py turns this path on only after a probe agrees with torch.exp on this machine;
   on an Intel CPU, where MKL dispatches to its AVX-512 kernel, the probe disagrees and
   vmsExp stays.

   The EX kernel, for |x| <= 87.336544 (0x42aeac4f, just above -ln(FLT_MIN)):
   1. t = x * (128 / ln 2) + 1.5 * 2^23. The addition rounds x * 128 / ln 2 to an integer
      m, held in t's low mantissa bits.
   2. j = m mod 128 picks a table entry 2^(j/128) = HI[j] + LO[j] (HI the nearest float,
      LO the nearest float to the rest; the same 128 pairs as MKL's table, compared in the
      probe through the results).
   3. n = t - 1.5 * 2^23 = m exactly. r = x - n * C_HI, then r = n * C_LO + r, with
      C_HI + C_LO = ln 2 / 128 (C_HI has 11 significant bits, so n * C_HI is exact).
   4. p = (r * r) * 0.5 + r, a degree-2 polynomial for exp(r) - 1.
   5. y = (p * HI + LO) + HI, then times 2^(m div 128): the scale's exponent field is
      (t << 16) + 1.0f's bits, masked to the exponent (m div 128 sits in bits 7 and up).
   Lanes with |x| above the bound (overflow, underflow to subnormals or 0, inf, NaN) take
   other branches of the EX kernel: a block of 16 lanes holding one is handed to vmsExp
   whole, as is the tail under 16 lanes.
*/
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*exp_routine_t)(int n, const float *a, float *r, long long mode);
static exp_routine_t EXP_REFERENCE; /* vmsExp */
static long long EXP_MODE;
static int EXP_EMULATED;            /* 1: exp_tile takes the AVX-512 path */
static float EXP_HI[128], EXP_LO[128];

#define EXP_BLOCK 4096 /* lanes per pass (the reduction's tile), so pending blocks fit */

/* The table from its definition: 2^(j/128) in long double (64 significant bits; HI and LO
   together keep 48) split into the nearest float and the nearest float to the rest. */
static void exp_table(void)
{
    for (int j = 0; j < 128; j++) {
        const long double v = exp2l((long double)j / 128.0L);
        EXP_HI[j] = (float)v;
        EXP_LO[j] = (float)(v - (long double)EXP_HI[j]);
    }
}

/* 1 when the AVX-512 path is on after the call: it needs the CPU's AVX-512F and a reference
   routine for the lanes it does not cover. */
int use_emulated_exp(void *reference, long long mode, int on)
{
    EXP_REFERENCE = (exp_routine_t)reference;
    EXP_MODE = mode;
    exp_table();
#if defined(__x86_64__)
    EXP_EMULATED = on && reference && __builtin_cpu_supports("avx512f");
#else
    (void)on;
    EXP_EMULATED = 0; /* (no AVX-512 path off x86-64: vmsExp stays) */
#endif
    return EXP_EMULATED;
}

#if defined(__x86_64__)
/* The 16-lane table lookup: vpermt2ps reads 32 entries from two registers (index bits 0-4),
   bits 5 and 6 of the index pick one of the four results. */
__attribute__((target("avx512f"), always_inline)) static inline __m512
exp_lookup(__m512 t0, __m512 t1, __m512 t2, __m512 t3, __m512 t4, __m512 t5, __m512 t6,
           __m512 t7, __m512i j, __mmask16 bit5, __mmask16 bit6)
{
    const __m512 low = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(t0, j, t1),
                                            _mm512_permutex2var_ps(t2, j, t3));
    const __m512 high = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(t4, j, t5),
                                             _mm512_permutex2var_ps(t6, j, t7));
    return _mm512_mask_blend_ps(bit6, low, high);
}

/* x[i] = exp(x[i]) for i < n <= EXP_BLOCK; returns how many 16-lane blocks went to vmsExp. */
__attribute__((target("avx512f"))) static int64_t exp_block_avx512(float *x, int64_t n)
{
    const __m512 to_steps = _mm512_castsi512_ps(_mm512_set1_epi32(0x4338aa3b)); /* 128/ln2 */
    const __m512 shifter = _mm512_set1_ps(12582912.0f);                       /* 1.5*2^23 */
    const __m512 unshifter = _mm512_set1_ps(-12582912.0f);
    const __m512 step_hi = _mm512_castsi512_ps(_mm512_set1_epi32(0x3bb18000));
    const __m512 step_lo = _mm512_castsi512_ps(_mm512_set1_epi32(0x35de8083));
    const __m512 half = _mm512_set1_ps(0.5f);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512i bound = _mm512_set1_epi32(0x42aeac4f);
    const __m512i index = _mm512_set1_epi32(127), b5 = _mm512_set1_epi32(32);
    const __m512i b6 = _mm512_set1_epi32(64);
    const __m512i one = _mm512_set1_epi32(0x3f800000), exponent = _mm512_set1_epi32(0x7f800000);
    const __m512 h0 = _mm512_loadu_ps(EXP_HI), h1 = _mm512_loadu_ps(EXP_HI + 16);
    const __m512 h2 = _mm512_loadu_ps(EXP_HI + 32), h3 = _mm512_loadu_ps(EXP_HI + 48);
    const __m512 h4 = _mm512_loadu_ps(EXP_HI + 64), h5 = _mm512_loadu_ps(EXP_HI + 80);
    const __m512 h6 = _mm512_loadu_ps(EXP_HI + 96), h7 = _mm512_loadu_ps(EXP_HI + 112);
    const __m512 l0 = _mm512_loadu_ps(EXP_LO), l1 = _mm512_loadu_ps(EXP_LO + 16);
    const __m512 l2 = _mm512_loadu_ps(EXP_LO + 32), l3 = _mm512_loadu_ps(EXP_LO + 48);
    const __m512 l4 = _mm512_loadu_ps(EXP_LO + 64), l5 = _mm512_loadu_ps(EXP_LO + 80);
    const __m512 l6 = _mm512_loadu_ps(EXP_LO + 96), l7 = _mm512_loadu_ps(EXP_LO + 112);
    int64_t pending[EXP_BLOCK / 16], waiting = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        /* the kernel's own test: the magnitude's bits, compared as signed integers */
        if (_mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude),
                                    bound)) {
            pending[waiting++] = i; /* (vmsExp after the loop: a call inside it spills) */
            continue;
        }
        const __m512 t = _mm512_add_ps(_mm512_mul_ps(v, to_steps), shifter);       /* 1 */
        const __m512i bits = _mm512_castps_si512(t);
        const __m512i j = _mm512_and_si512(bits, index);                           /* 2 */
        const __mmask16 bit5 = _mm512_test_epi32_mask(j, b5);
        const __mmask16 bit6 = _mm512_test_epi32_mask(j, b6);
        const __m512 hi = exp_lookup(h0, h1, h2, h3, h4, h5, h6, h7, j, bit5, bit6);
        const __m512 lo = exp_lookup(l0, l1, l2, l3, l4, l5, l6, l7, j, bit5, bit6);
        const __m512 steps = _mm512_add_ps(t, unshifter);                          /* 3 */
        __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(steps, step_hi));
        r = _mm512_add_ps(_mm512_mul_ps(steps, step_lo), r);
        const __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(r, r), half), r); /* 4 */
        const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, hi), lo), hi);  /* 5 */
        const __m512 scale = _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_add_epi32(_mm512_slli_epi32(bits, 16), one), exponent));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(y, scale));
    }
    for (int64_t k = 0; k < waiting; k++)
        EXP_REFERENCE(16, x + pending[k], x + pending[k], EXP_MODE);
    if (i < n) EXP_REFERENCE((int)(n - i), x + i, x + i, EXP_MODE);
    return waiting;
}

#endif

/* x[i] = exp(x[i]) for i < n, torch.exp's values: the AVX-512 path when it is on, else
   vmsExp itself. */
static void exp_tile(float *x, int64_t n)
{
    if (!EXP_EMULATED) {
        EXP_REFERENCE((int)n, x, x, EXP_MODE);
        return;
    }
#if defined(__x86_64__)
    for (int64_t start = 0; start < n; start += EXP_BLOCK)
        exp_block_avx512(x + start, n - start < EXP_BLOCK ? n - start : EXP_BLOCK);
#endif
}

/* exp_tile, exported for the probe and the tests. */
void exp_lanes(float *x, int64_t n) { exp_tile(x, n); }

/* How many of the `count` inputs whose bit patterns follow `first` (wrapping at 2^32) give
   another word from exp_tile than from vmsExp; *where gets the first such pattern. NaN
   results compare as words too (their payloads included). */
int64_t exp_mismatches(uint32_t first, uint64_t count, uint32_t *where)
{
    float in[EXP_BLOCK], want[EXP_BLOCK];
    int64_t differ = 0;
    for (uint64_t done = 0; done < count; done += EXP_BLOCK) {
        const int64_t n = count - done < EXP_BLOCK ? (int64_t)(count - done) : EXP_BLOCK;
        for (int64_t k = 0; k < n; k++) {
            const uint32_t bits = first + (uint32_t)(done + (uint64_t)k);
            memcpy(&in[k], &bits, 4);
        }
        EXP_REFERENCE((int)n, in, want, EXP_MODE);
        exp_tile(in, n);
        for (int64_t k = 0; k < n; k++) {
            if (memcmp(&in[k], &want[k], 4) == 0) continue;
            if (!differ) *where = first + (uint32_t)(done + (uint64_t)k);
            differ++;
        }
    }
    return differ;
}

int emulated_exp_on(void) { return EXP_EMULATED; }
