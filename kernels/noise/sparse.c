/* The Gumbel-max of sparse rows, scored in compiled code (ranks/sampler/gumbel.py). Built
   after philox.c and gumbel.c as one unit (kernels/noise/noise.c): it uses
   philox_bits, has_avx2, fill_row and fill_row_avx2 from there.

   A sparse row (a narrow vocabulary, or most lanes filtered to -inf) can only be won by its
   lanes at or above its FP32 cutoff `low` (the caller's rule). Per row, window by window:
   1. The window's lanes with x >= low (false for NaN, as in torch), in lane order.
   2. Their bits with the row's key and position, ids first + lane (philox_bits).
   3. Their scores as the torch path computes them, operation for operation:
      u = (m + 0.5) * 2**-52 (exact: m < 2**52), noise = -log(-log(u)) with `vln`, score =
      float64(x) + noise. `vln` is MKL's vmdLn in torch's mode, the routine torch's float64
      log_ calls (philox_native.py checks that on this machine before it passes it).
   4. The row's best (key, id) folded in as _settle folds candidates: the largest score key
      (the order-preserving int64 of the float64, -0.0 as +0.0), the smallest id among equal
      keys. A row without lanes at or above its cutoff keeps its (key, id). */

#define SCORE_WINDOW 256

typedef void (*vml_d)(int n, const double *a, double *r, long long mode);
typedef int (*mkl_threads_t)(int n);
typedef int (*mkl_max_threads_t)(void);

static inline int64_t score_key(double score)
{
    union { double d; int64_t i; } v = {score == 0 ? 0.0 : score};
    return v.i < 0 ? v.i ^ INT64_MAX : v.i;
}

static void score_row(const float *row, int64_t width, float low, int64_t first, uint32_t pos,
                      uint32_t k0, uint32_t k1, vml_d vln, long long mode, int64_t *key,
                      int64_t *id)
{
    int64_t lanes[SCORE_WINDOW], ids[SCORE_WINDOW], m[SCORE_WINDOW];
    double t[SCORE_WINDOW];
    int64_t best_key = *key, best_id = *id;
    for (int64_t w0 = 0; w0 < width; w0 += SCORE_WINDOW) {
        const int64_t span = width - w0 < SCORE_WINDOW ? width - w0 : SCORE_WINDOW;
        int64_t n;
#if defined(__x86_64__)
        if (has_avx2())
            n = fill_row_avx2(row + w0, span, low, 0, lanes);
        else
#endif
            n = fill_row(row + w0, 0, span, low, 0, lanes);
        if (n == 0) continue;
        for (int64_t i = 0; i < n; i++) ids[i] = first + w0 + lanes[i];
        philox_bits(ids, n, pos, k0, k1, m);
        for (int64_t i = 0; i < n; i++) t[i] = ((double)m[i] + 0.5) * 0x1p-52;
        vln((int)n, t, t, mode);
        for (int64_t i = 0; i < n; i++) t[i] = -t[i];
        vln((int)n, t, t, mode);
        for (int64_t i = 0; i < n; i++) {
            const int64_t k = score_key((double)row[w0 + lanes[i]] + -t[i]);
            if (k > best_key || (k == best_key && ids[i] < best_id)) {
                best_key = k;
                best_id = ids[i];
            }
        }
    }
    *key = best_key;
    *id = best_id;
}

/* Rows rows[0..n_rows) of x; low, pos, seed, key and id are indexed by the row (the key
   words are the seed's low and high 32 bits, the position is taken modulo 2**32). A row's
   vmdLn calls keep to one MKL thread, whatever `threads` is: outside a parallel region MKL
   would hand each window's call to its own thread team (on the engine's step thread, a
   wake-up of the team per call: serving the tiny model went from ~1,500 to ~400 tok/s when
   this was left to MKL). */
void sparse_best(const float *x, int64_t row_stride, const int64_t *rows, int64_t n_rows,
                 int64_t width, const float *low, const int64_t *pos, const int64_t *seed,
                 int64_t first, void *vln, long long mode,
                 void *local_threads, void *max_threads, int64_t *key, int64_t *id,
                 int64_t threads)
{
    const mkl_threads_t set_local = (mkl_threads_t)local_threads;
    const mkl_max_threads_t get_max = (mkl_max_threads_t)max_threads;
    const int toggle = set_local && (!get_max || get_max() > 1);
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t at = rows[r];
        const int previous = toggle ? set_local(1) : 0;
        score_row(x + at * row_stride, width, low[at], first, (uint32_t)pos[at],
                  (uint32_t)seed[at], (uint32_t)((uint64_t)seed[at] >> 32), (vml_d)vln, mode,
                  key + at, id + at);
        if (toggle) set_local(previous);
    }
}

/* ---- The candidates of dense rows, scored (ranks/sampler/gumbel.py, scaled_gumbel_best) ----

   gumbel_candidates leaves row r's counts[r] candidates at lanes, bits and values [r * cap
   ...]. Each is scored as step 3 above scores a lane (its value is the row's x there) and the
   row's best (key, id) is written to key[r], id[r]; a row with no candidates (counts[r] < 0:
   the caller takes its other path) is left as it was. */
void score_candidates(const int64_t *counts, int64_t n_rows, int64_t cap, const int64_t *lanes,
                      const int64_t *bits, const float *values, int64_t first, void *vln,
                      long long mode, void *local_threads, void *max_threads, int64_t *key,
                      int64_t *id, int64_t threads)
{
    const mkl_threads_t set_local = (mkl_threads_t)local_threads;
    const mkl_max_threads_t get_max = (mkl_max_threads_t)max_threads;
    const int toggle = set_local && (!get_max || get_max() > 1);
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        if (counts[r] <= 0) continue;
        const int previous = toggle ? set_local(1) : 0;
        int64_t best_key = key[r], best_id = id[r];
        double t[SCORE_WINDOW];
        for (int64_t w0 = 0; w0 < counts[r]; w0 += SCORE_WINDOW) {
            const int64_t n = counts[r] - w0 < SCORE_WINDOW ? counts[r] - w0 : SCORE_WINDOW;
            const int64_t at = r * cap + w0;
            for (int64_t i = 0; i < n; i++) t[i] = ((double)bits[at + i] + 0.5) * 0x1p-52;
            ((vml_d)vln)((int)n, t, t, mode);
            for (int64_t i = 0; i < n; i++) t[i] = -t[i];
            ((vml_d)vln)((int)n, t, t, mode);
            for (int64_t i = 0; i < n; i++) {
                const int64_t k = score_key((double)values[at + i] + -t[i]);
                const int64_t lane_id = first + lanes[at + i];
                if (k > best_key || (k == best_key && lane_id < best_id)) {
                    best_key = k;
                    best_id = lane_id;
                }
            }
        }
        key[r] = best_key;
        id[r] = best_id;
        if (toggle) set_local(previous);
    }
}
