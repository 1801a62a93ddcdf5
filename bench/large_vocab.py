"""A random checkpoint with the tiny model's shape and Qwen's 151,936-token vocabulary.

The weights are random (the head scaled up so that rows are peaked, like a trained model's).
The tokenizer is the tiny model's byte-level BPE grown to 151,936 entries by merges of
printable-ASCII pieces, so that every id past the tiny model's 1,031 decodes to whole
characters, as nearly every id of a real checkpoint does. (An earlier version kept the tiny
model's 1,031-entry tokenizer: nearly every sampled id then had no text, and a stream without
logprobs sent almost no chunks, which no real checkpoint does.)

    python -m bench.large_vocab        # builds it (cached), prints its directory
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

LARGE_VOCAB = 151_936
DEFAULT_CACHE = Path.home() / ".cache" / "helios"
MAX_PIECE_CHARS = 10
SPACE, NEWLINE = "\u0120", "\u010a"
"""Byte-level BPE's characters for b" " and b"\\n"; bytes 0x21-0x7e are themselves."""


def large_vocab_model(cache: Path = DEFAULT_CACHE) -> Path:
    """Build (once) and return the checkpoint's directory under `cache`."""
    target = cache / f"bench-vocab{LARGE_VOCAB}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from helios_logprobs.launch.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model()
    config = LlamaConfig.from_pretrained(tiny)
    config.vocab_size = LARGE_VOCAB
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # peaked, like a trained model's
    cache.mkdir(parents=True, exist_ok=True)
    staging = cache / f".{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, staging / name)
    tokenizer = json.loads((tiny / "tokenizer.json").read_text(encoding="utf-8"))
    grow_tokenizer(tokenizer, LARGE_VOCAB)
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False),
                                            encoding="utf-8")
    staging.rename(target)
    return target


def _printable(piece: str) -> bool:
    """Whole characters only: printable ASCII, with byte-level spaces and newlines."""
    return all(0x21 <= ord(c) <= 0x7E or c in (SPACE, NEWLINE) for c in piece)


def grow_tokenizer(tokenizer: dict, size: int, seed: int = LARGE_VOCAB) -> None:
    """Append BPE merges of printable pieces (in tokenizer.json's layout) until the vocabulary,
    added tokens included, holds `size` entries. Each new entry is two existing pieces joined,
    so every new id decodes to whole characters."""
    model = tokenizer["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list = model["merges"]
    used = set(vocab) | {t["content"] for t in tokenizer["added_tokens"]}
    next_id = max([*vocab.values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    heads = [p for p in vocab if _printable(p)]
    tails = [p for p in heads if not p.startswith((SPACE, NEWLINE))]
    rng = random.Random(seed)
    while next_id < size:
        left, right = rng.choice(heads), rng.choice(tails)
        piece = left + right
        if len(piece) > MAX_PIECE_CHARS or piece in used:
            continue
        used.add(piece)
        vocab[piece] = next_id
        merges.append([left, right])
        heads.append(piece)
        if not piece.startswith((SPACE, NEWLINE)):
            tails.append(piece)
        next_id += 1


if __name__ == "__main__":
    print(large_vocab_model())
