"""The reduction's FP32 exp: exp_lanes.c's AVX-512 copy vs MKL's vmsExp, same process.

    python -m bench.exp [--repeat N] [--threads T]

Two tables, each ratio "vmsExp time / copy time" from calls alternating in one run:
1. exp of one 4,096-lane tile in place (the reduction's unit), logit-like values in [-30, 0];
2. the one-rank reduction as the runtime calls it (kernels/cpu/backend.py's
   reduce_torch, K = 20, every row requested) on bf16 logits ~ N(0, 3^2), with the copy
   switched off and on (compiled.set_emulated_exp) between the calls.
The outputs of both sides are compared word for word before timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ctypes

import torch

from bench.reduction import time_pair
from helios_logprobs.kernels.api import row_request
from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.cpu.backend import reduce_torch
from helios_logprobs.kernels.native import VML_MODE, mkl_routine

K = 20
TILE = 4096


def tile_table(lib: ctypes.CDLL, repeat: int) -> None:
    vexp = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_longlong)(mkl_routine("vmsExp"))
    x = torch.rand(TILE, generator=torch.Generator().manual_seed(0)) * -30
    a, b = x.clone(), x.clone()
    vexp(TILE, a.data_ptr(), a.data_ptr(), VML_MODE)
    lib.exp_lanes(b.data_ptr(), TILE)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "the copy differs"
    calls = 200  # per sample: one call is a few microseconds

    def mkl() -> None:
        for _ in range(calls):
            ctypes.memmove(a.data_ptr(), x.data_ptr(), 4 * TILE)
            vexp(TILE, a.data_ptr(), a.data_ptr(), VML_MODE)

    def copy() -> None:
        for _ in range(calls):
            ctypes.memmove(b.data_ptr(), x.data_ptr(), 4 * TILE)
            lib.exp_lanes(b.data_ptr(), TILE)

    base, ours = time_pair([mkl, copy], repeat, torch.device("cpu"))
    print("| lanes | vmsExp ns/lane | copy ns/lane | ratio |\n|---|---|---|---|")
    per = calls * TILE / 1e9
    print(f"| {TILE:,} (after a memmove) | {base / per:.3f} | {ours / per:.3f} "
          f"| {base / ours:.2f}x |")


def reduction_line(lib: ctypes.CDLL, rows: int, vocab: int, repeat: int,
                   g: torch.Generator) -> str:
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16)
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    request = row_request(chosen, None, torch.ones(rows, dtype=torch.int32), K, vocab,
                          torch.device("cpu"))
    outs = [torch.empty(rows, 2 + 2 * 128, dtype=torch.int32) for _ in range(2)]

    def call(on: bool) -> None:
        compiled.set_emulated_exp(lib, on)
        reduce_torch(logits, request, vocab, outs[on])

    call(False)
    call(True)
    assert torch.equal(outs[0], outs[1]), "the payloads differ"
    base, ours = time_pair([lambda: call(False), lambda: call(True)], repeat,
                           torch.device("cpu"))
    return f"| {rows} | {vocab:,} | {base * 1e3:.3f} | {ours * 1e3:.3f} | {base / ours:.2f}x |"


def reduction_table(lib: ctypes.CDLL, repeat: int) -> None:
    print("\n| rows | vocab | vmsExp ms | copy ms | ratio |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    try:
        for vocab in (32_000, 151_936):
            for rows in (1, 16):
                print(reduction_line(lib, rows, vocab, repeat, g), flush=True)
    finally:
        compiled.set_emulated_exp(lib, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = compiled._lib()
    if lib is None or not compiled.emulated_exp():
        sys.exit("the copy is off here (no compiled reduction, no AVX-512F, or torch.exp is "
                 "another kernel): nothing to compare")
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} repeat={args.repeat} "
          f"(medians; {time.strftime('%Y-%m-%d')})\n")
    tile_table(lib, args.repeat)
    reduction_table(lib, args.repeat)


if __name__ == "__main__":
    main()
