/* The native extension's module entry (helios_logprobs.kernels._native).

   The extension is one shared object built at install from every C source of the package
   (pyproject.toml's ext-modules: this file, kernels/cpu/reduction.c, kernels/noise/noise.c,
   kernels/greedy/argmax.c, kernels/radix/radix.c and ranks/step/gate.c). kernels/native.py
   loads it with ctypes and declares every exported function's signature there; importing it
   gives an empty module. Without Python's headers at build time the entry still links (it
   then returns NULL and an import fails), so ctypes can use the functions either way. */
#if defined(__has_include)
#if __has_include(<Python.h>)
#define HELIOS_HAVE_PYTHON_H 1
#endif
#endif

#ifdef HELIOS_HAVE_PYTHON_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "helios-logprobs' native CPU kernels; kernels/native.py binds them with ctypes.", 0, NULL,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
#else
__attribute__((visibility("default"))) void *PyInit__native(void) { return 0; }
#endif
