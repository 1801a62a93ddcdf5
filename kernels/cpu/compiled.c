/* The CPU reduction's compiled launches (built into the native extension through
   kernels/cpu/reduction.c, with exp_lanes.c before this file and count.c after it).

   Every FP32 value here is the one the torch launches (kernels/cpu/tiles.py and
   lean.py) produce: exp and log are MKL's vmsExp / vmsLn in the mode torch's vml.h passes
   (or exp_lanes.c's copy of that exp where compiled.py's probe finds it the same),
   sums follow torch's cascade_sum order for its sum kernel's vector width, and every
   other step is one IEEE operation. compiled.py checks that on this machine before use.
*/
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*vml_t)(int n, const float *a, float *r, long long mode);
typedef int (*threads_t)(int n);
typedef int (*max_threads_t)(void);
static vml_t VEXP, VLN;
static threads_t MKL_LOCAL_THREADS; /* MKL_Set_Num_Threads_Local (C binding), or NULL */
static max_threads_t MKL_MAX_THREADS; /* MKL_Get_Max_Threads, or NULL */
static long long MODE;
static int WIDTH = 8;

void configure(void *vexp, void *vln, void *local_threads, void *max_threads, long long mode,
               int width)
{
    VEXP = (vml_t)vexp;
    VLN = (vml_t)vln;
    MKL_LOCAL_THREADS = (threads_t)local_threads;
    MKL_MAX_THREADS = (max_threads_t)max_threads;
    MODE = mode;
    WIDTH = width;
}

/* fn(jobs + i * size) for i < count, one job per thread of the process's OpenMP team:
   torch's own libgomp (the extension links libgomp.so.1, the soname torch has already
   loaded; kernels/native.py), whose threads have just run torch's intra-op work and are
   still spinning; new pthreads would compete with them for the same cores (measured: 32 x
   151,936 right after a torch op took the one-thread time). */
static void fan_out(void *(*fn)(void *), char *jobs, size_t size, int64_t count)
{
#pragma omp parallel for num_threads((int)count) schedule(static, 1)
    for (int64_t i = 0; i < count; i++) fn(jobs + i * size);
}

static int64_t ceil_log2(int64_t x)
{
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* torch's row_sum on scalars (ilp 4), for fewer lanes than one vector. */
static float scalar_sum(const float *x, int64_t size)
{
    float p[4] = {0.f, 0.f, 0.f, 0.f};
    int64_t rows = size / 4, i;
    for (i = 0; i < rows; i++)
        for (int k = 0; k < 4; k++) p[k] += x[i * 4 + k];
    for (i = rows * 4; i < size; i++) p[0] += x[i];
    for (int k = 1; k < 4; k++) p[0] += p[k];
    return p[0];
}

/* torch's vectorized_inner_sum for vectors of W lanes: multi_row_sum over rows of four
   vectors with four cascade levels, the leftover vectors into accumulator 0, accumulators
   1..3 into 0, then the scalar tail and the W lanes in order. */
#define VECTOR_SUM(W)                                                                      \
static float vector_sum_##W(const float *x, int64_t size0)                                 \
{                                                                                          \
    const int64_t vecs = size0 / W, rows = vecs / 4;                                       \
    int64_t power = ceil_log2(rows) / 4;                                                   \
    if (power < 4) power = 4;                                                              \
    const int64_t step = (int64_t)1 << power, mask = step - 1;                             \
    float acc[4][4][W];                                                                    \
    memset(acc, 0, sizeof(acc));                                                           \
    int64_t i = 0;                                                                         \
    while (i + step <= rows) {                                                             \
        for (int64_t j = 0; j < step; ++j, ++i)                                            \
            for (int k = 0; k < 4; k++)                                                    \
                for (int l = 0; l < W; l++) acc[0][k][l] += x[(i * 4 + k) * W + l];        \
        for (int j = 1; j < 4; j++) {                                                      \
            for (int k = 0; k < 4; k++)                                                    \
                for (int l = 0; l < W; l++) {                                              \
                    acc[j][k][l] += acc[j - 1][k][l];                                      \
                    acc[j - 1][k][l] = 0.f;                                                \
                }                                                                          \
            if ((i & (mask << (j * power))) != 0) break;                                   \
        }                                                                                  \
    }                                                                                      \
    for (; i < rows; ++i)                                                                  \
        for (int k = 0; k < 4; k++)                                                        \
            for (int l = 0; l < W; l++) acc[0][k][l] += x[(i * 4 + k) * W + l];            \
    for (int j = 1; j < 4; j++)                                                            \
        for (int k = 0; k < 4; k++)                                                        \
            for (int l = 0; l < W; l++) acc[0][k][l] += acc[j][k][l];                      \
    for (int64_t v = rows * 4; v < vecs; v++)                                              \
        for (int l = 0; l < W; l++) acc[0][0][l] += x[v * W + l];                          \
    for (int k = 1; k < 4; k++)                                                            \
        for (int l = 0; l < W; l++) acc[0][0][l] += acc[0][k][l];                          \
    float total = 0.f;                                                                     \
    for (int64_t k = vecs * W; k < size0; k++) total += x[k];                              \
    for (int l = 0; l < W; l++) total += acc[0][0][l];                                     \
    return total;                                                                          \
}
VECTOR_SUM(8)
VECTOR_SUM(16)

static float torch_sum(const float *x, int64_t n)
{
    if (n < WIDTH) return scalar_sum(x, n);
    return WIDTH == 16 ? vector_sum_16(x, n) : vector_sum_8(x, n);
}

static inline float widen_bf16(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* Moves the k largest of v[0..n) to the front (ids alongside; ties broken arbitrarily) and
   returns the largest value left behind (-inf when none): launch 3's candidates and the
   bound of every other lane. Quickselect with three-way partitions, so that long runs of
   equal values (bf16 ties) stay linear. NaN is not ordered here: callers that can meet one
   make the bound NaN themselves, so that launch 3 never vouches for such a row. */
static float top_k(float *v, int64_t *id, int64_t n, int64_t k)
{
    if (k >= n) return -INFINITY;
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        const float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a))
                                  : (a > c ? a : (b > c ? c : b));
        int64_t gt = lo, i = lo, lt = hi;
        while (i < lt) { /* [lo, gt) > pivot, [gt, i) equal, [lt, hi) < pivot */
            const float x = v[i];
            const int64_t xi = id[i];
            if (x > pivot) {
                v[i] = v[gt], id[i] = id[gt];
                v[gt] = x, id[gt] = xi;
                gt++, i++;
            } else if (x < pivot) {
                lt--;
                v[i] = v[lt], id[i] = id[lt];
                v[lt] = x, id[lt] = xi;
            } else {
                i++;
            }
        }
        if (k < gt) hi = gt;
        else if (k <= lt) break;
        else lo = lt;
    }
    float bound = -INFINITY;
    for (int64_t i = k; i < n; i++) bound = v[i] > bound ? v[i] : bound;
    return bound;
}

static inline float read_lane(const char *row, int64_t elem, int64_t lane)
{
    return elem == 2 ? widen_bf16(((const uint16_t *)row)[lane]) : ((const float *)row)[lane];
}

#define PICK_BUFFER 1024
typedef struct {
    float *raw;
    int64_t *lanes;
    int64_t count, cap;
    float floor, left;
} Picks;

/* Lane i (value x) joins the candidates unless it is below the floor (then only the largest
   value left out is kept); a full buffer is cut back to the cap largest first (raising the
   floor to the smallest value kept). */
static void offer(Picks *p, float x, int64_t i)
{
    if (!(x >= p->floor) && p->floor != -INFINITY) {
        p->left = x > p->left ? x : p->left;
        return;
    }
    if (p->count == PICK_BUFFER) {
        const float dropped = top_k(p->raw, p->lanes, p->count, p->cap);
        p->left = dropped > p->left ? dropped : p->left;
        p->count = p->cap;
        p->floor = p->raw[0];
        for (int64_t j = 1; j < p->cap; j++) p->floor = p->raw[j] < p->floor ? p->raw[j] : p->floor;
        if (!(x >= p->floor)) {
            p->left = x > p->left ? x : p->left;
            return;
        }
    }
    p->raw[p->count] = x;
    p->lanes[p->count++] = i;
}

/* The lanes of the strided chunk c0 + j of a tile starting at `start` (16 lanes, `width`
   apart): a chunk whose maximum is below the floor adds only that maximum to the values
   left out, without reading its lanes (a NaN maximum is read lane by lane). */
static void offer_chunk(Picks *p, const char *row, int64_t elem, float chunk_max,
                        int64_t first, int64_t width)
{
    if (chunk_max < p->floor) {
        p->left = chunk_max > p->left ? chunk_max : p->left;
        return;
    }
    for (int64_t k = 0; k < 16; k++) {
        const int64_t i = first + k * width;
        offer(p, read_lane(row, elem, i), i);
    }
}

/* The largest of v[0..n) that is not NaN (-inf when none), eight lanes at a time:
   _mm256_max_ps(lane, acc) keeps acc for a NaN lane, as `v > best ? v : best` does. Of a
   -0.0/+0.0 tie it may keep the other zero than a scalar loop would; every reader of these
   maxima takes -0.0 as +0.0 (torch's amax, which the probe compares with, is vectorized too). */
static float max_of(const float *v, int64_t n)
{
    int64_t i = 0;
    float best = -INFINITY;
#if defined(__x86_64__) /* (reduction.c compiles this file for AVX2) */
    __m256 a0 = _mm256_set1_ps(-INFINITY), a1 = a0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_max_ps(_mm256_loadu_ps(v + i), a0);
        a1 = _mm256_max_ps(_mm256_loadu_ps(v + i + 8), a1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(a1, a0));
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
#endif
    for (; i < n; i++) best = v[i] > best ? v[i] : best;
    return best;
}

/* The k largest of x[0..n) into raw/lanes[0, k) (k <= 64; lanes are indices into x) in one
   pass of a min-heap, an x equal to the root staying out; returns the largest value left out
   (-inf when none). Fewer than k values leave the heap partly filled. NaN never enters: the
   callers' rows that hold one are decided elsewhere (a NaN lse, or a NaN bound). The running
   maximum of the values left out is a branch, not a max: as a max it would chain every
   value's latency. For k << n this reads each value once and moves few (a quickselect moves
   and compares every value several times). */
static float heap_select(const float *x, int64_t n, int64_t k, float *raw, int64_t *lanes)
{
    int64_t size = 0, i = 0;
    float left = -INFINITY;
    for (; i < n && size < k; i++) { /* the first k values: sift up */
        const float v = x[i];
        if (v != v) continue;
        int64_t at = size++;
        while (at > 0 && raw[(at - 1) / 2] > v) {
            raw[at] = raw[(at - 1) / 2], lanes[at] = lanes[(at - 1) / 2];
            at = (at - 1) / 2;
        }
        raw[at] = v, lanes[at] = i;
    }
#if defined(__x86_64__)
    __m256 out8 = _mm256_set1_ps(-INFINITY); /* (the left-out maximum of whole blocks) */
#endif
    for (; i < n; i++) { /* the others replace the root when above it: sift down */
#if defined(__x86_64__)
        while (i + 8 <= n) { /* eight at a time while none of them is above the root */
            const __m256 v8 = _mm256_loadu_ps(x + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(v8, _mm256_set1_ps(raw[0]), _CMP_GT_OQ)))
                break;
            out8 = _mm256_max_ps(v8, out8); /* (a NaN lane keeps out8) */
            i += 8;
        }
#endif
        if (i == n) break;
        const float v = x[i];
        if (!(v > raw[0])) {
            if (v > left) left = v;
            continue;
        }
        if (raw[0] > left) left = raw[0];
        int64_t at = 0;
        for (;;) {
            int64_t child = 2 * at + 1;
            if (child >= k) break;
            if (child + 1 < k && raw[child + 1] < raw[child]) child++;
            if (!(raw[child] < v)) break;
            raw[at] = raw[child], lanes[at] = lanes[child];
            at = child;
        }
        raw[at] = v, lanes[at] = i;
    }
#if defined(__x86_64__)
    const float blocks = max_of((const float *)&out8, 8);
    return blocks > left ? blocks : left;
#else
    return left;
#endif
}

#define FEW_CHUNK_LANES (2 * 64 * 16 + 16)
/* Launch 1's picks per narrow row in reduce_rows: the m <= 20 best and a margin of 12 for
   ties at the m-th value (a tie that runs past the picks leaves the row to Python's tile
   path). compiled_tile_stats' callers choose their own count (lean_stats takes 64). */
#define FUSED_PICKS 32
/* pick_row for a row of under FEW_CHUNK_LANES lanes (its chunks are too few for the floor to
   skip many of them): the floor is the cap-th largest chunk maximum (cap distinct lanes reach
   it, so every lane of the row's cap largest is at or above it), and one pass over the
   row's lanes in order keeps those at or above the floor (a few dozen: the test is a branch
   that is almost never taken) and the largest of the others; a quickselect cuts the kept
   lanes back to cap. Every lane may be kept (ties at the floor), so the buffer holds a whole
   row. */
static float floor_picks(const char *row, int64_t elem, int64_t valid, const float *cmax,
                         int64_t chunks, int64_t cap, float *raw, int64_t *lanes)
{
    float kept_raw[FEW_CHUNK_LANES], top[64];
    int64_t kept_lanes[FEW_CHUNK_LANES], at[64];
    float floor = -INFINITY; /* with fewer than cap chunks every lane is kept */
    if (chunks >= cap) {
        heap_select(cmax, chunks, cap, top, at);
        floor = top[0]; /* the heap's root */
    }
    int64_t count = 0;
    float left = -INFINITY;
    for (int64_t i = 0; i < valid; i++) {
        const float x = read_lane(row, elem, i);
        if (x >= floor) {
            kept_raw[count] = x;
            kept_lanes[count++] = i;
        } else if (x > left) {
            left = x;
        }
    }
    const float bound = top_k(kept_raw, kept_lanes, count, cap);
    const int64_t keep = count < cap ? count : cap;
    memcpy(raw, kept_raw, sizeof(float) * (size_t)keep);
    memcpy(lanes, kept_lanes, sizeof(int64_t) * (size_t)keep);
    return bound > left ? bound : left;
}

/* Narrow rows (launch 1's picks): the row's `cap` largest raw values into raw/lanes[0, cap)
   (cap <= 64; PICK_BUFFER entries of scratch, whatever the row's width), returning the
   largest value left out (-inf when none). With at least cap chunks, the cap-th largest
   chunk maximum is <= the cap-th largest value (cap distinct lanes reach it), so lanes below
   it are left out at once: a chunk whose maximum is below the floor is never read; the lanes
   of the others collect in the buffer, which a quickselect cuts back to cap whenever it
   fills. The row's lanes are read from the logits again, never copied whole. A row of under
   FEW_CHUNK_LANES lanes has too few chunks for the floor to skip many: it takes floor_picks. */
static float pick_row(const char *row, int64_t elem, int64_t valid, int64_t tile,
                      const float *cmax, int64_t chunks, int64_t cap, float *raw,
                      int64_t *lanes)
{
    if (valid <= FEW_CHUNK_LANES)
        return floor_picks(row, elem, valid, cmax, chunks, cap, raw, lanes);
    Picks p = {raw, lanes, 0, cap, -INFINITY, -INFINITY};
    if (chunks >= cap) { /* the cap-th largest chunk maximum (a NaN chunk stays out: its row's
                            lse is NaN, so launch 3 never vouches for it) */
        float top[64] = {-INFINITY};
        int64_t at[64];
        heap_select(cmax, chunks, cap, top, at);
        p.floor = top[0];
    }
    if (p.floor == -INFINITY) {
        for (int64_t i = 0; i < valid; i++) offer(&p, read_lane(row, elem, i), i);
    } else {
        const int64_t full = valid / tile, per = tile / 16, rest = valid - full * tile;
        const int64_t tail = rest / 16, start = full * tile;
        for (int64_t t = 0; t < full; t++)
            for (int64_t j = 0; j < per; j++)
                offer_chunk(&p, row, elem, cmax[t * per + j], t * tile + j, per);
        for (int64_t j = 0; j < tail; j++)
            offer_chunk(&p, row, elem, cmax[full * per + j], start + j, tail);
        for (int64_t i = start + 16 * tail; i < valid; i++)
            offer(&p, read_lane(row, elem, i), i);
    }
    const float bound = top_k(raw, lanes, p.count, cap);
    return bound > p.left ? bound : p.left;
}

typedef struct {
    const char *base;
    int64_t elem, row_stride;
    const int64_t *rows;
    int64_t r0, r1, valid, tile, chunks, tiles, cap;
    float *cmax, *tmax, *tmass, *pick_raw, *pick_bound;
    int64_t *pick_lanes;
} Job;

/* Launch 1's maxima of one tile: chunk[j] = max over k < 16 of x[k * width + j] (NaN lanes
   skipped, the caller marks their chunks), *m = max of the chunks and of the lanes past
   16 * width, *nan_any whether any lane is NaN. One pass over the tile. */
#define TILE_MAXIMA(NAME, TYPE, LOAD)                                                      \
static void NAME(const TYPE *x, int64_t lanes, int64_t width, float *chunk, float *m,     \
                 int *nan_any)                                                             \
{                                                                                          \
    int nan = 0;                                                                           \
    for (int64_t j = 0; j < width; j++) {                                                  \
        const float v = LOAD(x[j]);                                                        \
        chunk[j] = v;                                                                      \
        nan |= v != v;                                                                     \
    }                                                                                      \
    for (int64_t k = 1; k < 16; k++) {                                                     \
        const TYPE *lane = x + k * width;                                                  \
        for (int64_t j = 0; j < width; j++) {                                              \
            const float v = LOAD(lane[j]);                                                 \
            chunk[j] = v > chunk[j] ? v : chunk[j];                                        \
            nan |= v != v;                                                                 \
        }                                                                                  \
    }                                                                                      \
    float best = max_of(chunk, width);                                                     \
    for (int64_t i = 16 * width; i < lanes; i++) {                                         \
        const float v = LOAD(x[i]);                                                        \
        best = v > best ? v : best;                                                        \
        nan |= v != v;                                                                     \
    }                                                                                      \
    *m = best;                                                                             \
    *nan_any = nan;                                                                        \
}

#define LOAD_F32(v) (v)
TILE_MAXIMA(tile_maxima_f32, float, LOAD_F32)
TILE_MAXIMA(tile_maxima_bf16, uint16_t, widen_bf16)

static void rows_of(const Job *job);

/* One tile's vmsExp must not fan out to MKL's own threads: with torch's intra-op threads
   (2 here) each 4,096-lane call would synchronize a team, and the row threads below would
   oversubscribe the cores (measured: 16 x 151,936 took 23 ms instead of 6). The thread's MKL
   setting is changed only when MKL has more than one thread: with one, setting and restoring
   it made the next forward's sgemm ~3.5% slower (16 rows of the tiny model, one thread). */
static void run_rows(const Job *job)
{
    const int toggle = MKL_LOCAL_THREADS && (!MKL_MAX_THREADS || MKL_MAX_THREADS() > 1);
    const int previous = toggle ? MKL_LOCAL_THREADS(1) : 0;
    rows_of(job);
    if (toggle) MKL_LOCAL_THREADS(previous);
}

static void rows_of(const Job *job)
{
    const int64_t tile = job->tile, valid = job->valid, full = valid / tile;
    const int64_t rest = valid - full * tile, per = tile / 16, tail = rest / 16;
    float *buf = (float *)malloc(sizeof(float) * (size_t)tile);
    float pick_raw[PICK_BUFFER];
    int64_t pick_lanes[PICK_BUFFER];
    const float qnan = NAN;
    for (int64_t r = job->r0; r < job->r1; r++) {
        const char *row = job->base + job->rows[r] * job->row_stride * job->elem;
        float *cmax = job->cmax + r * job->chunks;
        int row_nan = 0;
        for (int64_t t = 0; t <= full; t++) {
            const int64_t lanes = t < full ? tile : rest;
            if (lanes == 0) break;
            const int64_t start = t * tile;
            /* 1. chunk maxima over strided chunks straight from the row, and whether the
               tile holds a NaN; the tile maximum over the chunks and the lanes of no chunk;
               a NaN lane makes its chunk and tile NaN */
            const int64_t width = t < full ? per : tail;
            float *chunk = t < full ? cmax + t * per : cmax + full * per;
            int nan_any = 0;
            float m = -INFINITY;
            if (job->elem == 2) {
                const uint16_t *src = (const uint16_t *)row + start;
                tile_maxima_bf16(src, lanes, width, chunk, &m, &nan_any);
            } else {
                const float *src = (const float *)row + start;
                tile_maxima_f32(src, lanes, width, chunk, &m, &nan_any);
            }
            row_nan |= nan_any;
            if (nan_any) {
                m = qnan;
                for (int64_t k = 0; k < 16 * width; k++) {
                    const float v = read_lane(row, job->elem, start + k);
                    if (v != v) chunk[k % width] = qnan;
                }
            }
            job->tmax[r * job->tiles + t] = m;
            /* 2. the shifted tile (shift 0 for an all -inf tile) in FP32 scratch, exp as
               torch's exp_ does it (exp_lanes.c) */
            const float shift = m == -INFINITY ? 0.f : m;
            if (job->elem == 2) {
                const uint16_t *src = (const uint16_t *)row + start;
                for (int64_t i = 0; i < lanes; i++) buf[i] = widen_bf16(src[i]) - shift;
            } else {
                const float *src = (const float *)row + start;
                for (int64_t i = 0; i < lanes; i++) buf[i] = src[i] - shift;
            }
            exp_tile(buf, lanes);
            /* 3. the tile's mass in torch.sum's order */
            job->tmass[r * job->tiles + t] = torch_sum(buf, lanes);
        }
        if (job->cap) {
            /* 4. narrow rows: launch 3's candidates, the row's cap largest raw values, and the
               largest of the others */
            const float bound = pick_row(row, job->elem, valid, job->tile, cmax, job->chunks,
                                         job->cap, pick_raw, pick_lanes);
            job->pick_bound[r] = row_nan ? qnan : bound;
            memcpy(job->pick_raw + r * job->cap, pick_raw, sizeof(float) * (size_t)job->cap);
            memcpy(job->pick_lanes + r * job->cap, pick_lanes,
                   sizeof(int64_t) * (size_t)job->cap);
        }
    }
    free(buf);
}

static void *run_job(void *arg)
{
    run_rows((const Job *)arg);
    return NULL;
}

void tile_stats(const void *base, int64_t elem, int64_t row_stride, const int64_t *rows,
                int64_t n, int64_t valid, int64_t tile, float *cmax, float *tmax,
                float *tmass, int64_t cap, int64_t *pick_lanes, float *pick_raw,
                float *pick_bound, int64_t threads)
{
    const int64_t full = valid / tile, rest = valid - full * tile;
    Job job = {(const char *)base, elem, row_stride, rows, 0, n, valid, tile,
               full * (tile / 16) + rest / 16, full + (rest > 0), cap,
               cmax, tmax, tmass, pick_raw, pick_bound, pick_lanes};
    if (threads > n) threads = n;
    if (threads <= 1) {
        run_rows(&job);
        return;
    }
    Job jobs[64];
    if (threads > 64) threads = 64;
    for (int64_t i = 0; i < threads; i++) {
        jobs[i] = job;
        jobs[i].r0 = n * i / threads;
        jobs[i].r1 = n * (i + 1) / threads;
    }
    fan_out(run_job, (char *)jobs, sizeof(Job), threads);
}

/* Launch 2: each row's lse = log(S) + M (lean_lse): one tile gives (M, S) = (max, mass);
   more tiles are combined as combine() does (weights exp(max - shift) times the masses,
   summed in torch's order). A non-finite lse becomes NaN. */
void row_lse(const float *tmax, const float *tmass, int64_t n, int64_t tiles, float *big,
             float *mass, float *lse)
{
    float *w = (float *)malloc(sizeof(float) * (size_t)(tiles > 0 ? tiles : 1));
    for (int64_t r = 0; r < n; r++) {
        const float *mx = tmax + r * tiles, *ms = tmass + r * tiles;
        if (tiles == 1) {
            big[r] = mx[0];
            mass[r] = ms[0];
            continue;
        }
        float m = -INFINITY;
        int nan_any = 0;
        for (int64_t t = 0; t < tiles; t++) {
            m = mx[t] > m ? mx[t] : m;
            nan_any |= mx[t] != mx[t];
        }
        if (nan_any) m = NAN;
        const float shift = m == -INFINITY ? 0.f : m;
        for (int64_t t = 0; t < tiles; t++) w[t] = mx[t] - shift;
        VEXP((int)tiles, w, w, MODE);
        for (int64_t t = 0; t < tiles; t++) w[t] *= ms[t];
        big[r] = m;
        mass[r] = torch_sum(w, tiles);
    }
    free(w);
    VLN((int)n, mass, lse, MODE);
    for (int64_t r = 0; r < n; r++) {
        float v = lse[r] + big[r];
        lse[r] = isfinite(v) ? v : NAN;
    }
}

typedef struct {
    float value;
    int64_t lane;
} Entry;

/* (value desc, lane asc); -0.0 equals +0.0 */
static int before(const Entry *a, const Entry *b)
{
    return a->value > b->value || (a->value == b->value && a->lane < b->lane);
}

/* Launch 3 for one row with a finite lse (lean.py's rank_candidates): candidates are the lanes
   of the row's 64 highest chunks plus the tail's chunkless lanes (chunk mode, cm given; every
   other lane is at most the 65th chunk maximum), or launch 1's picks (pick mode, `picked`
   lanes, bound NULL when they are every lane). Their reported values v = raw - lse keep the
   best 64 (the 65th bounds the rest); those, ordered by (v desc, lane asc), are the row's
   exact best m when every bound is strictly below the m-th value: then it returns 1 and
   ids/values hold them (values with -0.0 as +0.0). `v`/`lanes` are scratch of at least
   scratch_size(valid, tile) entries. */
static int64_t scratch_size(int64_t valid, int64_t tile)
{
    const int64_t full = valid / tile, chunks = full * (tile / 16) + (valid - full * tile) / 16;
    return chunks > 64 * 16 + 16 ? chunks : 64 * 16 + 16;
}

static int best_row(const char *row, int64_t elem, int64_t valid, int64_t tile,
                    const float *cm, const float *tm, const int64_t *pick_lanes,
                    const float *pick_raw, const float *pick_bound, int64_t picked, float l,
                    int64_t m, float *v, int64_t *lanes, int64_t *ids, float *values)
{
    const int64_t full = valid / tile, rest = valid - full * tile, per = tile / 16;
    const int64_t tails = rest / 16, chunks = full * per + tails, loose = rest - tails * 16;
    int64_t count = 0, top[64];
    float bound = -INFINITY;
    if (!isfinite(l)) return 0;
    if (cm) {
        for (int64_t c = 0; c < full * per; c++) v[c] = cm[c];
        for (int64_t c = full * per; c < chunks; c++) v[c] = tm[c - full * per];
        float best[64];
        bound = heap_select(v, chunks, 64, best, top);
        const int64_t kept = chunks < 64 ? chunks : 64;
        for (int64_t i = 0; i < kept; i++) {
            const int64_t c = top[i];
            const int64_t first = c < full * per ? (c / per) * tile + c % per
                                                 : full * tile + (c - full * per);
            const int64_t stride = c < full * per ? per : tails;
            for (int64_t j = 0; j < 16; j++) lanes[count++] = first + stride * j;
        }
        for (int64_t i = valid - loose; i < valid; i++) lanes[count++] = i;
        for (int64_t i = 0; i < count; i++) v[i] = read_lane(row, elem, lanes[i]) - l;
    } else {
        for (int64_t i = 0; i < picked; i++) v[i] = pick_raw[i] - l, lanes[i] = pick_lanes[i];
        count = picked;
        if (pick_bound) bound = *pick_bound;
    }
    /* reported values: the best 64, the 65th bounding the rest */
    const float inner = top_k(v, lanes, count, 64);
    float limit = bound - l;
    if (count > 64 && !(inner <= limit)) limit = inner;
    const int64_t size = count < 64 ? count : 64;
    const int64_t take = m < size ? m : size;
    if (take == 0) return 0;
    /* the first `take` of the best 64 by (v desc, lane asc): an insertion sort that holds
       only `take` entries (an entry after the last held one is passed over) */
    Entry order[64];
    int64_t held = 0;
    for (int64_t i = 0; i < size; i++) {
        Entry e = {v[i] + 0.0f, lanes[i]};
        if (held == take && !before(&e, &order[take - 1])) continue;
        int64_t j = held < take ? held++ : take - 1;
        for (; j > 0 && before(&e, &order[j - 1]); j--) order[j] = order[j - 1];
        order[j] = e;
    }
    const int every = !cm && !pick_bound;
    if (!(every || limit < order[take - 1].value)) return 0;
    for (int64_t i = 0; i < take; i++) {
        ids[i] = order[i].lane;
        values[i] = order[i].value;
    }
    return 1;
}

/* Launch 3 on n rows (see best_row): exact[r] = 1 where ids/values [r, m] hold the row's
   best m. cmax/tail (row strides given) select chunk mode, else pick mode. */
void best_lanes(const void *base, int64_t elem, int64_t row_stride, const int64_t *rows,
                int64_t n, int64_t valid, int64_t tile, const float *cmax, int64_t cmax_stride,
                const float *tail, int64_t tail_stride, const int64_t *pick_lanes,
                const float *pick_raw, const float *pick_bound, int64_t picked,
                const float *lse, int64_t m, int64_t *ids, float *values, uint8_t *exact)
{
    const int64_t size = scratch_size(valid, tile);
    float *v = (float *)malloc(sizeof(float) * (size_t)size);
    int64_t *lanes = (int64_t *)malloc(sizeof(int64_t) * (size_t)size);
    for (int64_t r = 0; r < n; r++) {
        const char *row = (const char *)base + rows[r] * row_stride * elem;
        exact[r] = (uint8_t)best_row(
            row, elem, valid, tile, cmax ? cmax + r * cmax_stride : NULL,
            cmax ? tail + r * tail_stride : NULL, cmax ? NULL : pick_lanes + r * picked,
            cmax ? NULL : pick_raw + r * picked, pick_bound ? pick_bound + r : NULL, picked,
            lse[r], m, v, lanes, ids + r * m, values + r * m);
    }
    free(v);
    free(lanes);
}

static inline int32_t reported_bits(float raw, float l)
{
    union { float f; int32_t i; } v;
    v.f = l != l ? NAN : raw - l;
    return v.i;
}

/* The payload of rows [r0, r1) of a reduce_rows call (the chosen pair, the selected ids'
   pairs or the natural best m), with this thread's launch 3 scratch; `left` counts the rows
   it leaves for Python. */
typedef struct {
    const char *base;
    int64_t elem, row_stride;
    const int64_t *rows;
    int64_t r0, r1, valid, tile, k, m, cap;
    const int64_t *chosen;
    const int32_t *counts, *sel;
    const float *cmax, *lse, *pick_raw, *pick_bound;
    const int64_t *pick_lanes;
    int32_t *out;
    uint8_t *redo;
    int64_t left;
} PayloadJob;

static void payload_rows(PayloadJob *job)
{
    const int64_t valid = job->valid, tile = job->tile, full = valid / tile;
    const int64_t per = tile / 16, chunks = full * per + (valid - full * tile) / 16;
    const int64_t cap = job->cap, m = job->m, elem = job->elem;
    const int64_t size = scratch_size(valid, tile);
    float *v = (float *)malloc(sizeof(float) * (size_t)size);
    int64_t *lanes = (int64_t *)malloc(sizeof(int64_t) * (size_t)size);
    for (int64_t r = job->r0; r < job->r1; r++) {
        const int64_t at = job->rows[r];
        const char *row = job->base + at * job->row_stride * elem;
        int32_t *word = job->out + at * (2 + 2 * 128);
        const int64_t id = job->chosen[at], count = job->counts[at];
        const float l = job->lse[r];
        job->redo[r] = 0;
        for (int64_t w = 2; w < 2 + 2 * 128; w++) word[w] = -1;
        int bad = id < 0 || id >= valid || count < 0 || count > 128;
        for (int64_t s = 0; !bad && s < count; s++)
            bad = job->sel[at * 128 + s] < 0 || job->sel[at * 128 + s] >= valid;
        if (bad) {
            job->redo[r] = 2;
            job->left++;
            continue;
        }
        word[0] = (int32_t)id;
        word[1] = reported_bits(read_lane(row, elem, id), l);
        if (count > 0) {
            for (int64_t s = 0; s < count; s++) {
                const int32_t sid = job->sel[at * 128 + s];
                word[2 + 2 * s] = sid;
                word[3 + 2 * s] = reported_bits(read_lane(row, elem, sid), l);
            }
            continue;
        }
        if (job->k == 0) continue;
        int64_t ids[32];
        float values[32];
        const float *cm = job->cmax + r * chunks;
        const int found = best_row(
            row, elem, valid, tile, cap ? NULL : cm, cap ? NULL : cm + full * per,
            cap ? job->pick_lanes + r * cap : NULL, cap ? job->pick_raw + r * cap : NULL,
            cap && cap < valid ? job->pick_bound + r : NULL, cap, l, m, v, lanes, ids, values);
        if (!found) {
            job->redo[r] = 1;
            job->left++;
            continue;
        }
        for (int64_t i = 0; i < m; i++) {
            union { float f; int32_t i; } bits = {values[i]};
            word[2 + 2 * i] = (int32_t)ids[i];
            word[3 + 2 * i] = bits.i;
        }
    }
    free(v);
    free(lanes);
}

static void *run_payload(void *arg)
{
    payload_rows((PayloadJob *)arg);
    return NULL;
}

/* The whole one-rank reduction (lean.py's reduce_lean) into the packed payload rows
   out[rows[r]]: launches 1 and 2, the chosen pair, the selected ids' pairs (caller order,
   -1 beyond the count) or the natural best m. Returns the number of rows left for Python:
   redo[r] = 1 for a natural row whose candidates cannot vouch for its best m (the tile-by-
   tile launch 3 decides it; its pairs are left -1 here), 2 for a chosen or selected id
   outside [0, valid) (then the caller redoes the whole call its own way). cmax/tmax/tmass
   [n, ...] and lse [n] receive launches 1 and 2 for that. Launch 1 and the payload split
   their rows across `threads` threads. */
int64_t reduce_rows(const void *base, int64_t elem, int64_t row_stride, const int64_t *rows,
                    int64_t n, int64_t valid, int64_t tile, const int64_t *chosen,
                    const int32_t *counts, const int32_t *sel, int64_t k, int64_t m,
                    int64_t narrow, float *cmax, float *tmax, float *tmass, float *lse,
                    int32_t *out, uint8_t *redo, int64_t threads)
{
    const int64_t full = valid / tile, rest = valid - full * tile;
    const int64_t tiles = full + (rest > 0);
    const int64_t cap = narrow ? (valid < FUSED_PICKS ? valid : FUSED_PICKS) : 0;
    int64_t *pick_lanes = cap ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(n * cap)) : NULL;
    float *pick_raw = cap ? (float *)malloc(sizeof(float) * (size_t)(n * cap)) : NULL;
    float *pick_bound = cap ? (float *)malloc(sizeof(float) * (size_t)n) : NULL;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(2 * n + 1));
    tile_stats(base, elem, row_stride, rows, n, valid, tile, cmax, tmax, tmass, cap,
               pick_lanes, pick_raw, pick_bound, threads);
    row_lse(tmax, tmass, n, tiles, scratch, scratch + n, lse);
    PayloadJob job = {(const char *)base, elem, row_stride, rows, 0, n, valid, tile, k, m, cap,
                      chosen, counts, sel, cmax, lse, pick_raw, pick_bound, pick_lanes, out,
                      redo, 0};
    if (k == 0) threads = 1; /* (then a row's payload is a few words: not worth a thread) */
    if (threads > n) threads = n;
    if (threads > 64) threads = 64;
    int64_t left = 0;
    if (threads <= 1) {
        payload_rows(&job);
        left = job.left;
    } else {
        PayloadJob jobs[64];
        for (int64_t i = 0; i < threads; i++) {
            jobs[i] = job;
            jobs[i].r0 = n * i / threads;
            jobs[i].r1 = n * (i + 1) / threads;
        }
        fan_out(run_payload, (char *)jobs, sizeof(PayloadJob), threads);
        for (int64_t i = 0; i < threads; i++) left += jobs[i].left;
    }
    free(pick_lanes);
    free(pick_raw);
    free(pick_bound);
    free(scratch);
    return left;
}

/* reduce_rows for the rows whose flag (int32 [total]) is set, as the runtime's prepared
   reduction calls it with the same buffers every step: rows_out [total] receives their
   indices and *flagged their count. Launch 3 takes launch 1's picks when `narrow` is set
   and some flagged row has no selected ids; rows are split across `threads` threads when
   they hold at least `parallel_lanes` lanes. Returns reduce_rows' count of rows left. */
int64_t reduce_flagged(const void *base, int64_t elem, int64_t row_stride, const int32_t *flags,
                       int64_t total, int64_t valid, int64_t tile, const int64_t *chosen,
                       const int32_t *counts, const int32_t *sel, int64_t k, int64_t m,
                       int64_t narrow, float *cmax, float *tmax, float *tmass, float *lse,
                       int32_t *out, uint8_t *redo, int64_t threads, int64_t parallel_lanes,
                       int64_t *rows_out, int64_t *flagged)
{
    int64_t n = 0, natural = 0;
    for (int64_t r = 0; r < total; r++)
        if (flags[r]) {
            rows_out[n++] = r;
            natural |= counts[r] == 0;
        }
    *flagged = n;
    if (n == 0) return 0;
    if (n < 2 || n * valid < parallel_lanes) threads = 1;
    return reduce_rows(base, elem, row_stride, rows_out, n, valid, tile, chosen, counts, sel, k,
                       m, narrow && k > 0 && natural, cmax, tmax, tmass, lse, out, redo,
                       threads);
}

/* reduce_flagged's arguments but the thread count, prepared once (compiled.py's RepeatedCall)
   and passed by address: one pointer instead of 22 converted arguments per call, and
   ranks/step/gate.c calls it between the gate and the payload write through this
   function's address. */
typedef struct {
    const void *base;
    int64_t elem, row_stride;
    const int32_t *flags;
    int64_t total, valid, tile;
    const int64_t *chosen;
    const int32_t *counts, *sel;
    int64_t k, m, narrow;
    float *cmax, *tmax, *tmass, *lse;
    int32_t *out;
    uint8_t *redo;
    int64_t parallel_lanes;
    int64_t *rows_out, *flagged;
} FlaggedCall;

int64_t reduce_prepared(const FlaggedCall *c, int64_t threads)
{
    return reduce_flagged(c->base, c->elem, c->row_stride, c->flags, c->total, c->valid,
                          c->tile, c->chosen, c->counts, c->sel, c->k, c->m, c->narrow,
                          c->cmax, c->tmax, c->tmass, c->lse, c->out, c->redo, threads,
                          c->parallel_lanes, c->rows_out, c->flagged);
}
