"""The GPU tests' random Qwen2 checkpoint: tests/checkpoints.py write_qwen2 where transformers
imports, else the same layout written with safetensors alone (scripts/device_check.py
write_plain_qwen2): the GPU machine's image may lack transformers and cannot fetch it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_qwen2(path: Path, vocab_size: int = 301) -> Path:
    if importlib.util.find_spec("transformers") is not None:
        from tests.checkpoints import write_qwen2 as with_transformers

        return with_transformers(path, vocab_size=vocab_size)
    spec = importlib.util.spec_from_file_location("device_check",
                                                  REPO / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_plain_qwen2(path, vocab_size)
