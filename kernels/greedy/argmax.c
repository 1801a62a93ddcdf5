/* Greedy picks of raw logit rows (kernels/greedy/native.py binds them).

   row_argmax(x) is torch.argmax(nan_to_num(x, nan=-inf)) bit for bit in its answer: the first
   lane holding the row's largest value, NaN lanes counted as -inf, -0.0 equal to +0.0, and
   lane 0 when every lane is -inf or NaN. It reads the row once and never writes a copy:

   1. Maxima of tiles of TILE lanes with _mm256_max_ps(lane, acc), which returns acc when the
      lane is NaN (the second operand wins an unordered compare): NaN never becomes a maximum.
   2. The row maximum M over the tile maxima; M = -inf (only -inf and NaN lanes) -> lane 0.
   3. The first tile whose maximum equals M (== : -0.0 equals +0.0), then its first lane equal
      to M. That tile is read a second time, nothing else is.

   ISA: step 1 runs eight lanes at a time under target("avx2") where __builtin_cpu_supports
   finds AVX2 (x86-64; the extension itself is built for baseline x86-64), else in a scalar
   loop with the same rule (`v > m ? v : m` is false for NaN): both give the same answer.
   greedy_vector_level caps the level, so tests take both paths on one machine.
*/
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>

#define TILE 2048

static inline float lane(const void *row, int64_t elem, int64_t i)
{
    if (elem == 4) return ((const float *)row)[i];
    union { uint32_t u; float f; } w = { (uint32_t)((const uint16_t *)row)[i] << 16 };
    return w.f;
}

typedef float (*tile_max_t)(const void *row, int64_t elem, int64_t lo, int64_t hi);

/* Step 1 for lanes [lo, hi): the largest non-NaN value, -inf when there is none. */
static float tile_max_base(const void *row, int64_t elem, int64_t lo, int64_t hi)
{
    float m = -INFINITY;
    for (int64_t i = lo; i < hi; i++) {
        const float v = lane(row, elem, i);
        m = v > m ? v : m; /* (false for NaN) */
    }
    return m;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static inline __m256 load8(const void *row, int64_t elem,
                                                            int64_t i)
{
    if (elem == 4) return _mm256_loadu_ps((const float *)row + i);
    /* bfloat16: the upper half of an FP32 word (exact widening) */
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2"))) static float tile_max_avx2(const void *row, int64_t elem,
                                                            int64_t lo, int64_t hi)
{
    __m256 a0 = _mm256_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        a0 = _mm256_max_ps(load8(row, elem, i), a0);
        a1 = _mm256_max_ps(load8(row, elem, i + 8), a1);
        a2 = _mm256_max_ps(load8(row, elem, i + 16), a2);
        a3 = _mm256_max_ps(load8(row, elem, i + 24), a3);
    }
    for (; i + 8 <= hi; i += 8) a0 = _mm256_max_ps(load8(row, elem, i), a0);
    a0 = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    float acc[8], m = -INFINITY;
    _mm256_storeu_ps(acc, a0);
    for (int k = 0; k < 8; k++) m = acc[k] > m ? acc[k] : m;
    const float rest = tile_max_base(row, elem, i, hi);
    return rest > m ? rest : m;
}
#endif

/* 0 scalar, 1 AVX2: the best this CPU has, or less (greedy_vector_level). */
static int greedy_level = -1; /* -1: not asked yet */

static int greedy_cpu_level(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* Caps the vector level at `level` (at most what the CPU has); returns the level in use. */
int greedy_vector_level(int level)
{
    const int best = greedy_cpu_level();
    greedy_level = level < best ? (level < 0 ? 0 : level) : best;
    return greedy_level;
}

static int64_t row_argmax(const void *row, int64_t elem, int64_t n, tile_max_t tile_max)
{
    if (n <= 0) return 0;
    float maxima[(n + TILE - 1) / TILE];
    float best = -INFINITY;
    const int64_t tiles = (n + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t hi = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        maxima[t] = tile_max(row, elem, t * TILE, hi);
        best = maxima[t] > best ? maxima[t] : best;
    }
    if (best == -INFINITY) return 0;
    for (int64_t t = 0; t < tiles; t++) {
        if (maxima[t] != best) continue;
        const int64_t hi = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        for (int64_t i = t * TILE; i < hi; i++)
            if (lane(row, elem, i) == best) return i;
    }
    return 0; /* (unreachable: some tile holds the maximum) */
}

/* out[r] = row_argmax of row which[r] (of row r when `which` is NULL) for r < rows; rows are
   `lanes` wide and `row_stride` elements apart, and split across `threads` OpenMP threads. */
void greedy_argmax(const void *base, int64_t elem, int64_t row_stride, const int64_t *which,
                   int64_t rows, int64_t lanes, int64_t threads, int64_t *out)
{
    const char *bytes = (const char *)base;
    if (greedy_level < 0) greedy_level = greedy_cpu_level();
    tile_max_t tile_max = tile_max_base;
#if defined(__x86_64__)
    if (greedy_level >= 1) tile_max = tile_max_avx2;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t source = which ? which[r] : r;
        out[r] = row_argmax(bytes + source * row_stride * elem, elem, lanes, tile_max);
    }
}
