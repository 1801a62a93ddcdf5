"""The serving dtype of weights, activations and the KV cache (``--dtype``, vLLM's values).

``auto`` follows the checkpoint (config.json's ``torch_dtype``/``dtype``; float32 ones in
bfloat16, as vLLM serves them) on an accelerator. On CPU it is float32, the one exact choice:
bf16 and fp16 values are float32 values, while serving in bfloat16 rounds every activation
(SmolLM2's logprobs move by about 0.3). ``--dtype bfloat16`` is the faster opt-in where the CPU
has bf16 instructions (README: measured figures). The logprob math is FP32 whatever this is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CHOICES = ("auto", *DTYPES)


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """config.json's dtype when it names one of DTYPES."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = raw.get("dtype") or raw.get("torch_dtype") if isinstance(raw, dict) else None
    name = str(value).removeprefix("torch.") if value else None
    return name if name in DTYPES else None


def resolve_dtype(requested: str, device: str, model_dir: str | Path) -> tuple[str, str]:
    """(the dtype name, why it was chosen: for the start-up line)."""
    name = requested
    if name not in CHOICES:
        raise ValueError(f"unsupported dtype {requested!r}; expected one of {', '.join(CHOICES)}")
    if name != "auto":
        return name, "--dtype"
    if device == "cpu":
        return "float32", "auto: the exact choice on CPU"
    found = checkpoint_dtype(model_dir)
    if found is None:
        return "bfloat16", "auto: the checkpoint names no dtype"
    if found == "float32":  # served in 16 bits on an accelerator, as vLLM does
        return "bfloat16", "auto: a float32 checkpoint on an accelerator"
    return found, "auto: the checkpoint's dtype"
