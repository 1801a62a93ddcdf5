/* The CPU reduction as one translation unit of the native extension (pyproject.toml's
   ext-modules; kernels/cpu/compiled.py binds it): exp_lanes.c, compiled.c and count.c share
   static helpers (exp_tile), so they compile together, in this order.

   ISA: on x86-64 every function of the three files is compiled for AVX2 (the pragma below;
   the whole extension is built for baseline x86-64, no -mavx2), and exp_lanes.c's AVX-512
   exp is under target("avx512f") and taken only where __builtin_cpu_supports says so. The
   reduction repeats the summation order of torch's AVX2/AVX-512 sum kernel, which torch runs
   only on such CPUs, so it has no portable path of its own: reduction_supported() is 0 on a
   CPU without AVX2 and off x86-64, and compiled.py then keeps the torch path (the code still
   compiles there: x86 intrinsics sit under __x86_64__ guards).
*/
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 1 where this CPU runs the functions below (AVX2), else 0: callers must not call them. */
int reduction_supported(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
#endif

#include "exp_lanes.c"
#include "compiled.c"
#include "count.c"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
