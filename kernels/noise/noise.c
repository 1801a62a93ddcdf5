/* The Philox bits and the Gumbel-max searches as one translation unit of the native extension
   (pyproject.toml's ext-modules; kernels/noise/philox_native.py binds it): gumbel.c uses
   philox.c's static helpers and sparse.c both files', so they compile together, in this order.

   ISA: built for baseline x86-64 (no -mavx2); the AVX2 and AVX-512F loops sit under
   __attribute__((target(...))) and x86-64 guards, and philox.c's vector level, read from
   __builtin_cpu_supports at run time, picks them. Every level writes the same bits; other
   CPUs and machines take the scalar loops. */
#include "philox.c"
#include "gumbel.c"
#include "sparse.c"
