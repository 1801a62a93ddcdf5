/* The sampler's filters over CPU rows, in compiled code (kernels/radix/native.py binds them;
   ranks/sampler/filters.py holds the rounds, their exchanges and the torch path): the radix
   select, each row's best k values, and the cuts (at a key, and min-p's).

   Every value here is the one the torch path computes:
   - key of a lane = value_keys(x): the FP32 value's order-preserving 32-bit pattern (-0.0 as
     +0.0), as an unsigned number in [0, 2**32).
   - weight = 1 for every lane (top-k), or probability_weights: floor(p * scale) with p = 1
     where float64(x) equals the row maximum, else exp(float64(x) - maximum) through MKL's
     vmdExp in the mode torch's vml.h passes (the routine torch.exp calls for float64, so the
     same value); scale is a power of two, so the product and the floor are exact.
   - a round's histogram sums int64 weights per bucket: exact, so any order gives the torch
     path's sums.
   Per row the lanes are kept as (key, weight) pairs, and each round first
   drops the lanes outside the bucket the previous round chose (a stable compaction), then
   sums the rest into the buckets of its own bits. Rows fan out on OpenMP threads. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*vml_d)(int n, const double *a, double *r, long long mode);
typedef int (*threads_t)(int n);
typedef int (*max_threads_t)(void);

#define TILE 1024

/* Branch-free (signs are random: a branch would mispredict every other lane): -0.0 becomes
   +0.0, a negative pattern flips its 31 low bits, then the sign bit flips (+ 2**31). */
static inline uint32_t value_key(float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    b &= -(uint32_t)(v != 0.0f);
    return b ^ ((uint32_t)((int32_t)b >> 31) >> 1) ^ 0x80000000u;
}

/* The per-row loops are built for AVX2 and for the baseline (GCC's target clones, picked by
   the CPU at load time): the same IEEE operations either way. */
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* The int64 of p, an integer in [0, 2**52) held as a double: adding 2**52 puts it in the low
   mantissa bits exactly, which is (int64_t)p without a scalar conversion. */
static inline int64_t small_integer(double p)
{
    union { double d; int64_t i; } u = { .d = p + 0x1p52 };
    return u.i - 0x4330000000000000ll;
}

/* w[i] = floor(p * scale) of n lanes, p = 1 where x[i] equals the maximum; p is overwritten.
   The branch on the scale stays outside the loops, so both vectorize. */
static inline void weights_of(const float *x, double *p, int n, double maximum, double scale,
                              int64_t *w)
{
    for (int i = 0; i < n; i++) p[i] = floor(((double)x[i] == maximum ? 1.0 : p[i]) * scale);
    if (scale < 0x1p52) {
        for (int i = 0; i < n; i++) w[i] = small_integer(p[i]);
    } else { /* (vocabularies of at most 1,024 ids: a larger scale) */
        for (int i = 0; i < n; i++) w[i] = (int64_t)p[i];
    }
}

/* Keys and weights of the lanes of one row; returns how many it wrote. Unit weights (vexp
   NULL): every lane, with no branch and no data-dependent store, so the loops vectorize.
   Probability weights, tile by tile:
   1. d = float64(x) - maximum per lane. A lane is live when d >= zero_below, where
      zero_below = -log(scale) - 1/64: below it exp(d) * scale < e^(-1/64) < 1 for any exp
      within a few ulps of the true one, so torch's weight floor(p * scale) is 0, the lane
      adds nothing to any round's sum, and dropping it here changes no histogram. The live
      lanes are counted in FP32 (x >= maximum + zero_below, rounded): the count only picks
      step 2 or 3, and both give every live lane its exact weight.
   2. Most lanes live (rows of flat logits): vmdExp over the whole tile, every lane written,
      as the vector loops write them.
   3. Fewer than a quarter live (the peaked rows of confident models, low temperatures): only
      the lanes live by the exact test are gathered, passed to vmdExp and written. vmdExp's
      value of a lane does not depend on its neighbours or its place in the call (torch calls
      it in chunks of its own choosing), so the weights are torch's. */
CLONES static int64_t start_row(const float *row, int64_t width, double maximum, double scale,
                                vml_d vexp, long long mode, uint32_t *keys, int64_t *weights)
{
    if (!vexp) {
        for (int64_t i = 0; i < width; i++) keys[i] = value_key(row[i]);
        for (int64_t i = 0; i < width; i++) weights[i] = 1;
        return width;
    }
    const double zero_below = -log(scale) - 0x1p-6;
    const float live_from = (float)(maximum + zero_below);
    double shifted[TILE], p[TILE];
    int32_t at[TILE];
    int64_t written = 0;
    for (int64_t t = 0; t < width; t += TILE) {
        const int n = (int)(width - t < TILE ? width - t : TILE);
        const float *x = row + t;
        int live = 0; /* (a count to choose the branch by: FP32 is close enough) */
        for (int i = 0; i < n; i++) live += x[i] >= live_from;
        for (int i = 0; i < n; i++) shifted[i] = (double)x[i] - maximum;
        uint32_t *k = keys + written;
        int64_t *w = weights + written;
        if (4 * live >= n) {
            vexp(n, shifted, p, mode);
            for (int i = 0; i < n; i++) k[i] = value_key(x[i]);
            weights_of(x, p, n, maximum, scale, w);
            written += n;
            continue;
        }
        int m = 0, i = 0;
        for (; i + 16 <= n; i += 16) { /* (groups without a live lane are skipped whole) */
            int any = 0;
            for (int j = i; j < i + 16; j++) any |= !(shifted[j] < zero_below);
            if (!any) continue;
            for (int j = i; j < i + 16; j++) {
                shifted[m] = shifted[j]; /* (m <= j: read before it can be overwritten) */
                at[m] = j;
                m += !(shifted[j] < zero_below);
            }
        }
        for (; i < n; i++) {
            shifted[m] = shifted[i];
            at[m] = i;
            m += !(shifted[i] < zero_below);
        }
        float live_x[TILE];
        for (int j = 0; j < m; j++) live_x[j] = x[at[j]];
        if (m) vexp(m, shifted, p, mode);
        for (int j = 0; j < m; j++) k[j] = value_key(live_x[j]);
        weights_of(live_x, p, m, maximum, scale, w);
        written += m;
    }
    return written;
}

/* vexp NULL: unit weights (row_max and scale unused). Rows of keys and weights are `width`
   apart. The thread's MKL threads are set to one around the row (as in the compiled
   reduction: a tile's vmdExp must not fan out while the rows already do). */
void radix_start(const float *x, int64_t row_stride, int64_t n_rows, int64_t width,
                 const double *row_max, double scale, void *vexp, long long mode,
                 void *local_threads, void *max_threads, uint32_t *keys, int64_t *weights,
                 int64_t *counts, int64_t threads)
{
    const threads_t set_local = (threads_t)local_threads;
    const max_threads_t get_max = (max_threads_t)max_threads;
    const int toggle = vexp && set_local && (!get_max || get_max() > 1);
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int previous = toggle ? set_local(1) : 0;
        counts[r] = start_row(x + r * row_stride, width, vexp ? row_max[r] : 0.0, scale,
                              (vml_d)vexp, mode, keys + r * width, weights + r * width);
        if (toggle) set_local(previous);
    }
}

/* One row of a round: drop the lanes outside `bucket` of the previous round's bits (bucket
   < 0: none), then sum into h; returns the lanes left. */
CLONES static int64_t round_row(uint32_t *k, int64_t *w, int64_t n, int keep_shift,
                                int keep_bits, int64_t bucket, int shift, int bits, int64_t *h)
{
    if (bucket >= 0) {
        const uint32_t mask = (1u << keep_bits) - 1, want = (uint32_t)bucket;
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t key = k[i];
            const int64_t weight = w[i];
            k[kept] = key; /* (written always, kept only when inside: no branch) */
            w[kept] = weight;
            kept += ((key >> keep_shift) & mask) == want;
        }
        n = kept;
    }
    /* Four partial histograms: most lanes share a bucket or two, and one histogram would
       chain every add behind the previous store to the same slot. */
    int64_t part[4][128];
    const int64_t buckets = (int64_t)1 << bits;
    const uint32_t mask = (1u << bits) - 1;
    memset(part, 0, sizeof part);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) part[j][(k[i + j] >> shift) & mask] += w[i + j];
    for (; i < n; i++) part[0][(k[i] >> shift) & mask] += w[i];
    for (int64_t b = 0; b < buckets; b++) h[b] = part[0][b] + part[1][b] + part[2][b] + part[3][b];
    return n;
}

/* chosen NULL: the first round (nothing to drop). hist: int64 [n_rows, 2**bits]. */
void radix_round(uint32_t *keys, int64_t *weights, int64_t *counts, int64_t n_rows,
                 int64_t width, int keep_shift, int keep_bits, const int64_t *chosen,
                 int shift, int bits, int64_t *hist, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++)
        counts[r] = round_row(keys + r * width, weights + r * width, counts[r], keep_shift,
                              keep_bits, chosen ? chosen[r] : -1, shift, bits,
                              hist + (r << bits));
}

CLONES static void below_row(const float *row, int64_t width, int64_t cut, uint8_t *out)
{
    for (int64_t i = 0; i < width; i++) out[i] = (int64_t)value_key(row[i]) < cut;
}

/* out[r, i] = value_keys(x[r, i]) < cut[r] (bytes 0/1, torch.bool's layout). */
void radix_below(const float *x, int64_t row_stride, int64_t n_rows, int64_t width,
                 const int64_t *cut, uint8_t *out, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++)
        below_row(x + r * row_stride, width, cut[r], out + r * width);
}

CLONES static void fill_below_row(float *row, int64_t width, int64_t cut)
{
    for (int64_t i = 0; i < width; i++)
        row[i] = (int64_t)value_key(row[i]) < cut ? -INFINITY : row[i];
}

/* x[r, i] = -inf where value_keys(x[r, i]) < cut[r], in place: radix_below and a masked fill
   in one pass. */
void radix_fill_below(float *x, int64_t row_stride, int64_t n_rows, int64_t width,
                      const int64_t *cut, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) fill_below_row(x + r * row_stride, width, cut[r]);
}

/* ---- Each row's k largest values, in descending order (max_and_topk) --------------------

   Only values leave here (the exchange sends their words), so which of two equal lanes is
   kept does not matter, and NaN never occurs (the scratch has none). Per row, a min-heap of
   k values: a lane enters when it exceeds the heap's smallest. Lanes are read 16 at a time
   and a block whose maximum does not exceed that smallest value is skipped whole, which is
   nearly every block once the heap holds large values. The heap is then sorted in place. */
static void sift_down(float *heap, int64_t n, int64_t i)
{
    const float v = heap[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] < heap[c]) c++;
        if (!(heap[c] < v)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

static inline void offer(float *heap, int64_t k, float v)
{
    if (v > heap[0]) {
        heap[0] = v;
        sift_down(heap, k, 0);
    }
}

CLONES static void top_row(const float *row, int64_t width, int64_t k, float *heap)
{
    for (int64_t i = 0; i < k; i++) heap[i] = row[i];
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    int64_t i = k;
    for (; i + 16 <= width; i += 16) {
        float most = row[i];
        for (int j = 1; j < 16; j++) most = row[i + j] > most ? row[i + j] : most;
        if (!(most > heap[0])) continue;
        for (int j = 0; j < 16; j++) offer(heap, k, row[i + j]);
    }
    for (; i < width; i++) offer(heap, k, row[i]);
    for (int64_t n = k; n > 1; n--) { /* the smallest to the end: descending order */
        const float least = heap[0];
        heap[0] = heap[n - 1];
        sift_down(heap, n - 1, 0);
        heap[n - 1] = least;
    }
}

/* out [n_rows, k]: row r's k largest values, largest first (1 <= k <= width). */
void radix_top_values(const float *x, int64_t row_stride, int64_t n_rows, int64_t width,
                      int64_t k, float *out, int64_t threads)
{
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) top_row(x + r * row_stride, width, k, out + r * k);
}

/* ---- min-p: drop the lanes whose relative probability is below the row's floor -----------

   The torch path keeps a lane when p >= floor, p = 1 where float64(x) equals the row maximum
   m, else exp(float64(x) - m) through torch's float64 exp (vmdExp). exp is within an ulp or
   two of the true value, so only a lane whose d = float64(x) - m lies within a hair of
   log(floor) can go either way: a lane with d above log(floor) + 1e-9 keeps (its p exceeds
   floor by a factor e**1e-9 before any rounding), one below log(floor) - 1e-9 goes, and
   only the lanes between get p from vmdExp, a tile at a time, to compare as torch does.
   -inf lanes give d = -inf (dropped; floor > 0); an infinite maximum is equal to itself. */
static void min_p_row(float *row, int64_t width, double m, double floor_, vml_d vexp,
                      long long mode)
{
    const double low = log(floor_) - 1e-9, high = log(floor_) + 1e-9;
    int64_t near[TILE];
    double d[TILE], p[TILE];
    for (int64_t t = 0; t < width; t += TILE) {
        const int64_t n = width - t < TILE ? width - t : TILE;
        int64_t found = 0;
        for (int64_t i = t; i < t + n; i++) {
            const double xd = (double)row[i];
            if (xd == m) continue;
            const double gap = xd - m;
            if (gap > high) continue;
            if (gap < low) {
                row[i] = -INFINITY;
                continue;
            }
            near[found] = i;
            d[found++] = gap;
        }
        if (!found) continue;
        vexp((int)found, d, p, mode);
        for (int64_t j = 0; j < found; j++)
            if (p[j] < floor_) row[near[j]] = -INFINITY;
    }
}

/* Rows x[r] with maximum row_max[r] and floor floors[r] (in (0, 1]), in place. */
void radix_min_p(float *x, int64_t row_stride, int64_t n_rows, int64_t width,
                 const double *row_max, const double *floors, void *vexp, long long mode,
                 void *local_threads, void *max_threads, int64_t threads)
{
    const threads_t set_local = (threads_t)local_threads;
    const max_threads_t get_max = (max_threads_t)max_threads;
    const int toggle = set_local && (!get_max || get_max() > 1);
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int previous = toggle ? set_local(1) : 0;
        min_p_row(x + r * row_stride, width, row_max[r], floors[r], (vml_d)vexp, mode);
        if (toggle) set_local(previous);
    }
}
