
/* Prompt scoring's rank count (kernels/scoring/steps.py count_above), appended to compiled.c:
   per row r, how many of the first `valid` lanes have a reported value fp32(x) - lse[r]
   strictly above value[r]. The subtraction and the comparison are the torch path's two IEEE
   operations, so the counts are its counts; a NaN lse or value compares false everywhere and
   counts nothing, as torch's `>` does. Rows spread over `threads` OpenMP threads. */
void count_above(const char *base, int64_t elem, int64_t row_stride, int64_t n, int64_t valid,
                 const float *lse, const float *value, int64_t *out, int64_t threads)
{
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)(threads < 1 ? 1 : threads)) schedule(static)
#endif
    for (int64_t r = 0; r < n; r++) {
        const float shift = lse[r], bar = value[r];
        int64_t above = 0;
        if (elem == 2) {
            const uint16_t *x = (const uint16_t *)base + r * row_stride;
            for (int64_t i = 0; i < valid; i++) above += (widen_bf16(x[i]) - shift) > bar;
        } else {
            const float *x = (const float *)base + r * row_stride;
            for (int64_t i = 0; i < valid; i++) above += (x[i] - shift) > bar;
        }
        out[r] = above;
    }
    (void)threads;
}
