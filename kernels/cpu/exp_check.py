"""Whether exp_lanes.c's AVX-512 exp gives torch.exp's words on this machine.

exp_lanes.c repeats the arithmetic of the MKL kernel that torch.exp runs on an AMD CPU. On
another CPU (or another MKL) torch.exp may run another kernel with other roundings, so
compiled.py turns the copy on only after `differs` finds no lane that disagrees among
inputs chosen to catch any other algorithm: patterns spread over all 2^32 words, the
logit-like range, values next to the roundings of step 1 (x * 128 / ln 2 half-way between
integers) and both sides of the kernel's bound. tests/unit/kernels/test_exp_lanes.py sweeps
every word.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import numpy as np
import torch

BOUND = 0x42AEAC4F
"""|x|'s bits above which the EX kernel leaves its main branch (exp_lanes.c)."""


def probe_inputs() -> torch.Tensor:
    """About 150,000 FP32 inputs (see the module's docstring)."""
    gen = torch.Generator().manual_seed(20261202)
    spread = (np.arange(1 << 16, dtype=np.uint64) * 65537 + 12345) % (1 << 32)
    steps = np.arange(-11_200, 11_200, 3, dtype=np.float64) + 0.5
    halves = np.float32(steps * math.log(2) / 128)
    near = [np.nextafter(halves, np.float32(sign * np.inf)) for sign in (1, -1)]
    edge = np.arange(BOUND - 64, BOUND + 65, dtype=np.uint32)
    words = np.concatenate([spread.astype(np.uint32), edge, edge | np.uint32(1 << 31)])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.2e-38, -88.0,
                        88.8, -103.9, -104.0], dtype=np.float32)
    parts = [words.view(np.float32), halves, *near, special,
             (torch.rand(1 << 15, generator=gen) * 176 - 88).numpy(),
             (torch.rand(1 << 15, generator=gen) * -25).numpy()]
    return torch.from_numpy(np.concatenate(parts).astype(np.float32))


def differs(lib: ctypes.CDLL,
            reference: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> str:
    """'' when lib.exp_lanes gives reference's words on every probe input, else the first
    input (as its bit pattern) where they differ."""
    x = probe_inputs()
    want = reference(x)
    got = x.clone()
    lib.exp_lanes(got.data_ptr(), got.numel())
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    if bad.numel() == 0:
        return ""
    i = int(bad[0, 0])
    word, ours, theirs = (int(t.view(torch.int32)[i]) & 0xFFFFFFFF for t in (x, got, want))
    return f"exp of word 0x{word:08x} gave 0x{ours:08x} where the reference gives 0x{theirs:08x}"
