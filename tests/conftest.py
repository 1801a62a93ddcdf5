from __future__ import annotations

import os

import torch

# Triton kernels run on CPU through the interpreter unless a GPU is present. This must be set
# before triton is first imported in the worker process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
