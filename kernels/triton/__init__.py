"""Triton kernels and their launchers: the only modules that import triton (optional)."""
