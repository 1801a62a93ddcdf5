/* The Gumbel-max's searches over CPU rows (ranks/sampler/gumbel.py), in compiled code: noise
   bounds, the candidates of dense rows and the lanes of sparse ones. Built after philox.c in
   one unit (kernels/noise/noise.c): it uses philox_bits, has_avx2, vector_level
   and BLOCK from there. */

/* The FP32 noise bound of bits m: c0 - c1 * (the int32 pattern of FP32(h)), h = (2**52 - 1 - m)
   >> 21, rounded step by step as kernels.noise.philox.gumbel_bounds rounds it (no contraction:
   built with -ffp-contract=off). */
static inline float bound_of(int64_t m, float c0, float c1)
{
    union { float f; int32_t b; } h;
    h.f = (float)(int32_t)((uint64_t)(m ^ 0xFFFFFFFFFFFFFll) >> 21);
    return c0 - c1 * (float)h.b;
}

void gumbel_bounds(const int64_t *m, int64_t n, float c0, float c1, float *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = bound_of(m[i], c0, c1);
}

/* ---- The Gumbel-max candidates of dense rows (ranks/sampler/gumbel.py) -------------------

   A row's score of lane j is float64(x[j]) + noise(m_j), noise = -log(-log(u)), u = (m + 0.5)
   / 2**52; the winner has the largest score. Only a few lanes' noise can decide the winner,
   but a lane's bits must be drawn unless its x alone rules it out. Per row:
   0. x is the row as the sampler's scratch holds it. Given `temps`, x is read from the raw
      logits: each lane NaN as -inf, then divided by the row's FP32 temperature (IEEE
      division, as torch's div_), so a temperature-only row needs no scratch copy.
   1. Each kept lane's bits m and FP32 bound b = x + bound_of(m), above its score by 1e-3
      before rounding, and the largest b of each block of BLOCK lanes. Jobs of whole blocks,
      several per row when rows are fewer than threads. A row whose largest x is not finite
      or exceeds x_limit in size reports -2 (the caller takes its other path: the margins
      below assume scores of moderate size).
      Which lanes are kept: no noise exceeds GUMBEL_CEILING, so a lane whose x is below the
      score s of another lane less GUMBEL_CEILING can neither win nor tie. Each job keeps the
      exact score s (C's log) of the first lane holding the largest x it has met (renewed
      when that x rises by 1 or more: each costs two logs), and leaves out the lanes below
      that cut (raw_cut: in raw values, with margins for the logs and the division),
      compacted in lane order (block_lanes). A row's final cut is its jobs' highest; the
      jobs after a row's first start from the cut of its first SEED_LANES lanes. Rows spread
      wide over the noise's range (low temperatures, confident rows) lose most lanes to it.
      A block where more than 3/4 of the lanes reach the cut draws every lane's bits
      (compaction would cost more than it saves), and so do the blocks after it, without
      counting, until the cut rises or RETRY_BLOCKS blocks on.
   2. The lead is the first kept lane with the row's largest b (its block's bits are drawn
      again to find it, under the row's final cut). s0 is the larger of its score, with C's
      log, and the jobs' cut scores: within 1e-12 (1 + |s0|) of the score torch computes (each
      log is within a few ulps of the true value). Some lane scores s0, so the winner scores
      >= s0, and a lane that scores >= s0 has b >= s0 - (1e-3 + 2**-20 (1 + |s0|))
      (dense_row_best in ranks/sampler/gumbel.py gives why); the threshold h is that less
      another 1e-9 (1 + |s0|) for C's log, as FP32 rounded down.
   3. Blocks whose maximum reaches h draw their kept lanes' bits again (under the row's final
      cut, which keeps fewer lanes or the same); those with b >= h are the candidates,
      written with their bits and x (the caller scores them exactly, as torch does). A row
      with more than `cap` candidates reports -1 (the caller takes its other path). */
#include <stdlib.h>

#define GUMBEL_CEILING 36.75 /* > -log(-log(1 - 2**-53)) = 36.7368..., the largest noise */
#define RETRY_BLOCKS 32 /* a job drawing every lane under a cut tries it again this often */
#define SEED_LANES 4096 /* the lanes whose largest x gives a row's later jobs their first cut */

/* A lane's x: NaN as -inf, divided by t (t = 1 leaves it, so rows already scaled pass 1). */
static inline float scaled(float v, float t)
{
    return (v != v ? -INFINITY : v) / t;
}

/* Bits and bounds of lanes [lane0, lane0 + count) of a row of raw values scaled by t; returns
   their largest bound, and their largest x in *top. Written once, built for AVX-512F, AVX2
   and the baseline (bounds_avx512, bounds_avx2, bounds_base). */
static inline __attribute__((always_inline)) float bounds_body(
    const float *x, int64_t lane0, int64_t count, int64_t first, uint32_t pos, uint32_t k0,
    uint32_t k1, float c0, float c1, float t, int64_t *m, float *b, float *top)
{
    int64_t ids[BLOCK];
    for (int64_t i = 0; i < count; i++) ids[i] = first + lane0 + i;
    philox_bits(ids, count, pos, k0, k1, m);
    float best = -INFINITY, high = -INFINITY;
    if (t == 1.0f) { /* (no division) */
#pragma omp simd reduction(max : best, high)
        for (int64_t i = 0; i < count; i++) {
            const float v = x[lane0 + i] != x[lane0 + i] ? -INFINITY : x[lane0 + i];
            b[i] = v + bound_of(m[i], c0, c1);
            best = b[i] > best ? b[i] : best;
            high = v > high ? v : high;
        }
    } else {
#pragma omp simd reduction(max : best, high)
        for (int64_t i = 0; i < count; i++) {
            const float v = scaled(x[lane0 + i], t);
            b[i] = v + bound_of(m[i], c0, c1);
            best = b[i] > best ? b[i] : best;
            high = v > high ? v : high;
        }
    }
    *top = high;
    return best;
}

/* The lanes of [lane0, lane0 + count) whose raw value reaches `low` (raw_cut; a
   NaN lane never does), compacted in lane order: their block-local lanes into idx and their
   values, divided by t, into v (each with room for count + 16); returns how many. */
static inline __attribute__((always_inline)) int64_t kept_from(
    const float *x, int64_t lane0, int64_t i, int64_t count, float t, float low, int32_t *idx,
    float *v, int64_t n) /* (lanes from i on, n kept before them) */
{
    for (; i < count; i++) { /* (branch-free: a kept lane moves n on) */
        idx[n] = (int32_t)i;
        v[n] = x[lane0 + i];
        n += x[lane0 + i] >= low;
    }
#pragma omp simd
    for (int64_t k = 0; k < n; k++) v[k] /= t;
    return n;
}

static int64_t kept_body(const float *x, int64_t lane0, int64_t count, float t, float low,
                         int32_t *idx, float *v)
{
    return kept_from(x, lane0, 0, count, t, low, idx, v, 0);
}

/* Bits and bounds of n compacted lanes (values v, block-local lanes idx); returns their
   largest bound. */
static inline __attribute__((always_inline)) float kept_bounds_body(
    const int32_t *idx, const float *v, int64_t n, int64_t lane0, int64_t first, uint32_t pos,
    uint32_t k0, uint32_t k1, float c0, float c1, int64_t *m, float *b)
{
    /* (n rounded up to whole 8-lane vectors, the last id repeated: the scalar tail of
       philox_bits costs more per lane than the vectors' spare lanes) */
    const int64_t whole = (n + 7) & ~(int64_t)7;
    int64_t ids[BLOCK];
#pragma omp simd
    for (int64_t k = 0; k < n; k++) ids[k] = first + lane0 + idx[k];
    for (int64_t k = n; k < whole; k++) ids[k] = ids[n - 1];
    philox_bits(ids, whole, pos, k0, k1, m);
    float best = -INFINITY;
#pragma omp simd reduction(max : best)
    for (int64_t k = 0; k < n; k++) {
        b[k] = v[k] + bound_of(m[k], c0, c1);
        best = b[k] > best ? b[k] : best;
    }
    return best;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static float bounds_avx512(
    const float *x, int64_t lane0, int64_t count, int64_t first, uint32_t pos, uint32_t k0,
    uint32_t k1, float c0, float c1, float t, int64_t *m, float *b, float *top)
{
    return bounds_body(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
}

__attribute__((target("avx2"))) static float bounds_avx2(
    const float *x, int64_t lane0, int64_t count, int64_t first, uint32_t pos, uint32_t k0,
    uint32_t k1, float c0, float c1, float t, int64_t *m, float *b, float *top)
{
    return bounds_body(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
}

/* kept_body with AVX-512F's in-register compaction, 16 lanes a step (the register form:
   the store form is microcoded on some CPUs). */
__attribute__((target("avx512f"))) static int64_t kept_avx512(
    const float *x, int64_t lane0, int64_t count, float t, float low, int32_t *idx, float *v)
{
    const __m512 c = _mm512_set1_ps(low);
    const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t n = 0, i = 0;
    for (; i + 16 <= count; i += 16) {
        const __m512 a = _mm512_loadu_ps(x + lane0 + i);
        const __mmask16 keep = _mm512_cmp_ps_mask(a, c, _CMP_GE_OQ); /* (NaN: false) */
        _mm512_storeu_ps(v + n, _mm512_maskz_compress_ps(keep, a));
        _mm512_storeu_si512((void *)(idx + n), _mm512_maskz_compress_epi32(
            keep, _mm512_add_epi32(step, _mm512_set1_epi32((int)i))));
        n += __builtin_popcount((unsigned)keep);
    }
    return kept_from(x, lane0, i, count, t, low, idx, v, n);
}

__attribute__((target("avx512f"))) static float kept_bounds_avx512(
    const int32_t *idx, const float *v, int64_t n, int64_t lane0, int64_t first, uint32_t pos,
    uint32_t k0, uint32_t k1, float c0, float c1, int64_t *m, float *b)
{
    return kept_bounds_body(idx, v, n, lane0, first, pos, k0, k1, c0, c1, m, b);
}

__attribute__((target("avx2"))) static float kept_bounds_avx2(
    const int32_t *idx, const float *v, int64_t n, int64_t lane0, int64_t first, uint32_t pos,
    uint32_t k0, uint32_t k1, float c0, float c1, int64_t *m, float *b)
{
    return kept_bounds_body(idx, v, n, lane0, first, pos, k0, k1, c0, c1, m, b);
}
#endif

static float bounds_base(const float *x, int64_t lane0, int64_t count, int64_t first,
                         uint32_t pos, uint32_t k0, uint32_t k1, float c0, float c1, float t,
                         int64_t *m, float *b, float *top)
{
    return bounds_body(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
}

static float block_bounds(const float *x, int64_t lane0, int64_t count, int64_t first,
                          uint32_t pos, uint32_t k0, uint32_t k1, float c0, float c1, float t,
                          int64_t *m, float *b, float *top)
{
#if defined(__x86_64__)
    if (has_avx2() && vector_level >= 2)
        return bounds_avx512(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
    if (has_avx2())
        return bounds_avx2(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
#endif
    return bounds_base(x, lane0, count, first, pos, k0, k1, c0, c1, t, m, b, top);
}

/* The lanes of one block that can still win: all `count` lanes (pruned = 0: lane k is k, its
   x is read again from the row), or the n at or above the row's cut, compacted. */
typedef struct {
    int64_t n;
    int pruned;
    int crowded; /* (a cut was asked for, but more than 3/4 of the lanes reach it) */
    int32_t idx[BLOCK + 16];
    float v[BLOCK + 16];
    int64_t m[BLOCK];
    float b[BLOCK];
} BlockLanes;

/* Fills L for lanes [lane0, lane0 + count) and returns their largest bound; *top is the
   largest x of the kept lanes (of every lane without a cut: a lane left out is below it).
   Where more than 3/4 of the lanes reach the cut, every lane is kept (crowded): compaction
   would cost more than it saves. */
static float block_lanes(const float *x, int64_t lane0, int64_t count, int64_t first,
                         uint32_t pos, uint32_t k0, uint32_t k1, float c0, float c1, float t,
                         float cut, BlockLanes *L, float *top)
{
    L->crowded = 0;
    if (cut != -INFINITY) {
#if defined(__x86_64__)
        if (has_avx2() && vector_level >= 2)
            L->n = kept_avx512(x, lane0, count, t, cut, L->idx, L->v);
        else
            L->n = kept_body(x, lane0, count, t, cut, L->idx, L->v);
#else
        L->n = kept_body(x, lane0, count, t, cut, L->idx, L->v);
#endif
        L->crowded = 4 * L->n > 3 * count;
    }
    L->pruned = cut != -INFINITY && !L->crowded;
    if (!L->pruned) {
        L->n = count;
        return block_bounds(x, lane0, count, first, pos, k0, k1, c0, c1, t, L->m, L->b, top);
    }
    float high = -INFINITY;
    for (int64_t k = 0; k < L->n; k++) high = L->v[k] > high ? L->v[k] : high;
    *top = high;
    if (L->n == 0) return -INFINITY;
#if defined(__x86_64__)
    if (has_avx2() && vector_level >= 2)
        return kept_bounds_avx512(L->idx, L->v, L->n, lane0, first, pos, k0, k1, c0, c1, L->m,
                                  L->b);
    if (has_avx2())
        return kept_bounds_avx2(L->idx, L->v, L->n, lane0, first, pos, k0, k1, c0, c1, L->m,
                                L->b);
#endif
    return kept_bounds_body(L->idx, L->v, L->n, lane0, first, pos, k0, k1, c0, c1, L->m, L->b);
}

static inline int64_t lane_of(const BlockLanes *L, int64_t k)
{
    return L->pruned ? L->idx[k] : k;
}

static inline float value_of(const BlockLanes *L, const float *row, int64_t lane0, int64_t k,
                             float t)
{
    return L->pruned ? L->v[k] : scaled(row[lane0 + k], t);
}

/* The score, with C's log, of the first kept lane of L whose x is `top` (of the lane the
   search stops at, whichever it is: a score of some lane is all a cut needs). */
static double top_score(const BlockLanes *L, const float *row, int64_t lane0, float t,
                        float top, int64_t first, uint32_t pos, uint32_t k0, uint32_t k1)
{
    int64_t k = 0;
    while (k < L->n - 1 && !(value_of(L, row, lane0, k, t) == top)) k++;
    int64_t id = first + lane0 + lane_of(L, k), m;
    philox_bits(&id, 1, pos, k0, k1, &m);
    return (double)value_of(L, row, lane0, k, t) - log(-log(((double)m + 0.5) * 0x1p-52));
}

/* The raw cut of a lane score s (C's log): a lane whose raw value is below it has
   fl(x / t) < cut = s - GUMBEL_CEILING - 1e-9 (1 + |s|), so it scores below the torch score
   of the lane behind s: it neither wins nor ties. In raw values x < low gives x / t < cut - e
   (x < low <= (cut - e) t, the product's rounding taken off), and e, two FP32 ulps of |cut|
   and at least two of the smallest subnormal, keeps the rounded quotient below cut. */
static float raw_cut(double s, float t)
{
    const double cut = s - GUMBEL_CEILING - 1e-9 * (1.0 + fabs(s));
    const float size = (float)fabs(cut);
    double e = 2.0 * ((double)nextafterf(size, INFINITY) - (double)size);
    if (e < 0x1p-148) e = 0x1p-148;
    double low_ = (cut - e) * (double)t;
    low_ -= fabs(low_) * 0x1p-50;
    float low = (float)low_;
    if ((double)low > low_) low = nextafterf(low, -INFINITY);
    return low;
}

/* The score, with C's log, of the first lane holding the largest x among the row's first
   SEED_LANES lanes; -inf where that x is not finite or exceeds x_limit in size. In a
   vocabulary ordered by merges (BPE), a row's likely tokens sit at low ids: this gives the
   jobs of a row split over threads the cut that its first job finds there. */
static double seed_score(const float *row, int64_t width, float t, int64_t first, uint32_t pos,
                         uint32_t k0, uint32_t k1, double x_limit)
{
    const int64_t n = width < SEED_LANES ? width : SEED_LANES;
    float most = -INFINITY;
#pragma omp simd reduction(max : most)
    for (int64_t i = 0; i < n; i++) {
        const float v = row[i] != row[i] ? -INFINITY : row[i];
        most = v > most ? v : most;
    }
    const float top = scaled(most, t); /* (division by t > 0 keeps the order) */
    if (!(isfinite(top) && fabs((double)top) <= x_limit)) return -INFINITY;
    int64_t at = 0;
    while (!(row[at] == most)) at++; /* (most is finite: some lane holds it) */
    int64_t id = first + at, m;
    philox_bits(&id, 1, pos, k0, k1, &m);
    return (double)scaled(row[at], t) - log(-log(((double)m + 0.5) * 0x1p-52));
}

void gumbel_candidates(const float *x, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                       int64_t width, int64_t first, const int64_t *pos, const int64_t *k0,
                       const int64_t *k1, const float *temps, float c0, float c1,
                       double x_limit, float *maxima, float *lead_value, int64_t *lead_block,
                       float *lead_x, int64_t cap, int64_t *counts, int64_t *lanes,
                       int64_t *bits, float *values, int64_t threads)
{
    const int64_t blocks = (width + BLOCK - 1) / BLOCK;
    int64_t chunks = n_rows >= threads ? 1 : threads / n_rows;
    if (chunks > blocks) chunks = blocks;
    const int64_t per_chunk = (blocks + chunks - 1) / chunks;
    chunks = (blocks + per_chunk - 1) / per_chunk; /* none empty */
    const int64_t jobs = n_rows * chunks;
    float *cuts = malloc((size_t)jobs * sizeof(float));
    double *cut_scores = malloc((size_t)jobs * sizeof(double));
    if (cuts == NULL || cut_scores == NULL) { /* (the caller's other path) */
        free(cuts);
        free(cut_scores);
        for (int64_t r = 0; r < n_rows; r++) counts[r] = -2;
        return;
    }

    /* 1. block maxima, each job's first block with its largest maximum, its largest x and
       its final cut */
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t r = job / chunks, c = job % chunks;
        const float *row = x + rows[r] * row_stride;
        const float t = temps ? temps[r] : 1.0f;
        const uint32_t p = (uint32_t)pos[r], a = (uint32_t)k0[r], b1 = (uint32_t)k1[r];
        BlockLanes L;
        float best = -INFINITY, high = -INFINITY, top, low = -INFINITY, cut_top = -INFINITY;
        double s = -INFINITY;
        int every = 1; /* (no cut yet, or the last block kept most of its lanes) */
        if (c > 0) { /* (a later job starts from the row's first lanes' cut) */
            s = seed_score(row, width, t, first, p, a, b1, x_limit);
            if (s > -INFINITY) {
                low = raw_cut(s, t);
                every = 0;
            }
        }
        int64_t lead = c * per_chunk;
        for (int64_t k = c * per_chunk; k < (c + 1) * per_chunk && k < blocks; k++) {
            int64_t lane0 = k * BLOCK, count = width - lane0 < BLOCK ? width - lane0 : BLOCK;
            const int cut = !every || (k % RETRY_BLOCKS == 0 && low != -INFINITY);
            float most = block_lanes(row, lane0, count, first, p, a, b1, c0, c1, t,
                                     cut ? low : -INFINITY, &L, &top);
            if (cut) every = L.crowded;
            maxima[r * blocks + k] = most;
            if (most > best) {
                best = most;
                lead = k;
            }
            high = top > high ? top : high;
            if (top >= cut_top + 1.0f && isfinite(top) && fabs((double)top) <= x_limit) {
                cut_top = top; /* (a new cut only for a step of 1 or more: each costs a log) */
                const double score = top_score(&L, row, lane0, t, top, first, p, a, b1);
                if (score > s) {
                    s = score;
                    low = raw_cut(s, t);
                    every = 0;
                }
            }
        }
        lead_value[job] = best;
        lead_block[job] = lead;
        lead_x[job] = high;
        cuts[job] = low;
        cut_scores[job] = s;
    }

    /* 2. and 3. per row: the threshold, then the candidates */
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *row = x + rows[r] * row_stride;
        const float t = temps ? temps[r] : 1.0f;
        const uint32_t p = (uint32_t)pos[r], a = (uint32_t)k0[r], b1 = (uint32_t)k1[r];
        int64_t block = lead_block[r * chunks];
        float best = lead_value[r * chunks], high = lead_x[r * chunks], top;
        float low = cuts[r * chunks];
        double s_cut = cut_scores[r * chunks];
        for (int64_t c = 1; c < chunks; c++) {
            if (lead_value[r * chunks + c] > best) {
                best = lead_value[r * chunks + c];
                block = lead_block[r * chunks + c];
            }
            high = lead_x[r * chunks + c] > high ? lead_x[r * chunks + c] : high;
            low = cuts[r * chunks + c] > low ? cuts[r * chunks + c] : low;
            s_cut = cut_scores[r * chunks + c] > s_cut ? cut_scores[r * chunks + c] : s_cut;
        }
        if (!(isfinite(high) && fabs((double)high) <= x_limit)) {
            counts[r] = -2;
            continue;
        }
        BlockLanes L;
        int64_t lane0 = block * BLOCK, lead = 0;
        int64_t count = width - lane0 < BLOCK ? width - lane0 : BLOCK;
        block_lanes(row, lane0, count, first, p, a, b1, c0, c1, t, low, &L, &top);
        double s0 = s_cut; /* (the lead block keeps no lane only where the row has a cut) */
        if (L.n > 0) {
            while (lead < L.n - 1 && L.b[lead] != best) lead++;
            const double u = ((double)L.m[lead] + 0.5) * 0x1p-52;
            const double lead_score = (double)value_of(&L, row, lane0, lead, t) - log(-log(u));
            s0 = lead_score > s0 ? lead_score : s0;
        }
        const double slack = 1.0 + fabs(s0);
        const double floor_ = s0 - (1e-3 + 0x1p-20 * slack) - 1e-9 * slack;
        float threshold = (float)floor_;
        if ((double)threshold > floor_) threshold = nextafterf(threshold, -INFINITY);

        int64_t found = 0;
        for (int64_t k = 0; k < blocks && found >= 0; k++) {
            if (!(maxima[r * blocks + k] >= threshold)) continue;
            lane0 = k * BLOCK;
            count = width - lane0 < BLOCK ? width - lane0 : BLOCK;
            block_lanes(row, lane0, count, first, p, a, b1, c0, c1, t, low, &L, &top);
            for (int64_t q = 0; q < L.n; q++) {
                if (!(L.b[q] >= threshold)) continue;
                if (found == cap) {
                    found = -1;
                    break;
                }
                lanes[r * cap + found] = lane0 + lane_of(&L, q);
                bits[r * cap + found] = L.m[q];
                values[r * cap + found] = value_of(&L, row, lane0, q, t);
                found++;
            }
        }
        counts[r] = found;
    }
    free(cuts);
    free(cut_scores);
}

/* ---- The sampler's scratch rows of unprocessed batches ------------------------------------

   dst[r] = src[r] as the scratch holds it after the copy and the temperature: NaN as -inf,
   then divided by t[r] (IEEE division, as torch's div_; t = 1 only copies), in one pass
   instead of torch's copy and division. Built for AVX-512F, AVX2 and the baseline. */
static inline __attribute__((always_inline)) void scale_body(const float *src, int64_t n,
                                                             float t, float *dst)
{
    if (t == 1.0f) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = src[i] != src[i] ? -INFINITY : src[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = scaled(src[i], t);
    }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void scale_avx512(const float *src, int64_t n,
                                                            float t, float *dst)
{
    scale_body(src, n, t, dst);
}

__attribute__((target("avx2"))) static void scale_avx2(const float *src, int64_t n, float t,
                                                       float *dst)
{
    scale_body(src, n, t, dst);
}
#endif

static void scale_base(const float *src, int64_t n, float t, float *dst)
{
    scale_body(src, n, t, dst);
}

void scaled_rows(const float *src, int64_t src_stride, int64_t n_rows, int64_t width,
                 const float *temps, float *dst, int64_t dst_stride, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *from = src + r * src_stride;
        float *to = dst + r * dst_stride;
#if defined(__x86_64__)
        if (has_avx2() && vector_level >= 2) {
            scale_avx512(from, width, temps[r], to);
            continue;
        }
        if (has_avx2()) {
            scale_avx2(from, width, temps[r], to);
            continue;
        }
#endif
        scale_base(from, width, temps[r], to);
    }
}

/* ---- The lanes of sparse rows that can still win (ranks/sampler/gumbel.py) ------------------

   A row whose lanes mostly sit far below its maximum (filtered to -inf by top-k, top-p or
   min-p, or spread wide) keeps only the lanes at or above its FP32 cutoff `low`; the caller
   draws their noise. Two passes over the rows: counts, then (after the caller sized the
   output) the lanes in row-major order, as torch.nonzero(x >= low) lists them. A NaN lane or
   cutoff compares false, as in torch. */
static int64_t count_row(const float *row, int64_t width, float low)
{
    int64_t count = 0;
    for (int64_t i = 0; i < width; i++) count += row[i] >= low;
    return count;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static int64_t count_row_avx2(const float *row, int64_t width,
                                                              float low)
{
    return count_row(row, width, low);
}
#endif

void cutoff_counts(const float *x, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                   int64_t width, const float *low, int64_t *counts, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *row = x + rows[r] * row_stride;
#if defined(__x86_64__)
        if (has_avx2()) {
            counts[r] = count_row_avx2(row, width, low[r]);
            continue;
        }
#endif
        counts[r] = count_row(row, width, low[r]);
    }
}

/* The lanes from `from` on with row[i] >= low, into lanes[k...]; returns the new k. The AVX2
   build tests 8 lanes at once (_CMP_GE_OQ: false for NaN, as the scalar >=) and visits only
   set bits. */
static int64_t fill_row(const float *row, int64_t from, int64_t width, float low, int64_t k,
                        int64_t *lanes)
{
    for (int64_t i = from; i < width; i++)
        if (row[i] >= low) lanes[k++] = i;
    return k;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static int64_t fill_row_avx2(const float *row, int64_t width,
                                                             float low, int64_t k,
                                                             int64_t *lanes)
{
    const __m256 t = _mm256_set1_ps(low);
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(row + i), t, _CMP_GE_OQ));
        while (mask) {
            lanes[k++] = i + __builtin_ctz(mask);
            mask &= mask - 1;
        }
    }
    return fill_row(row, i, width, low, k, lanes);
}
#endif

/* Row r's lanes go to lane_out[offsets[r] ...], its row index rows[r] beside each. */
void cutoff_lanes(const float *x, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                  int64_t width, const float *low, const int64_t *offsets, int64_t *row_out,
                  int64_t *lane_out, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const float *row = x + rows[r] * row_stride;
        const int64_t start = offsets[r];
        int64_t end;
#if defined(__x86_64__)
        if (has_avx2())
            end = fill_row_avx2(row, width, low[r], start, lane_out);
        else
#endif
            end = fill_row(row, 0, width, low[r], start, lane_out);
        for (int64_t k = start; k < end; k++) row_out[k] = rows[r];
    }
}
