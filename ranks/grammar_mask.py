"""A grammar bitmask row (xgrammar's layout, computed on the coordinator for the whole
vocabulary) -> the lanes of this rank's vocabulary shard that the grammar forbids.

The row is little-endian int32 words, bit j of word w set when global token 32 w + j is
allowed. A shard holds global ids [vocab_start, vocab_start + local_valid), which need not
start on a word boundary (a vocabulary TP does not divide), so the row is unpacked to one bit
per id and sliced at the shard's range: rank r never reads another shard's bits, and the
union of the shards' slices is exactly the row.

The sampler masks these lanes with -inf in its scratch rows, before every other logits
processor (vLLM applies the grammar bitmask to the logits before its sampler runs); the raw
logits, which the logprob reduction reads, are never masked (the contract: reported
logprobs precede the grammar).
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def allowed_ids(row: bytes, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: the ids a bitmask row allows (every shard's view, for tests)."""
    return _bits(row, vocab_size)[:vocab_size]


def _check(row: bytes, vocab_size: int) -> None:
    if len(row) != 4 * bitmask_words(vocab_size):
        raise ValueError(f"a grammar bitmask row over {vocab_size} ids has "
                         f"{4 * bitmask_words(vocab_size)} bytes, got {len(row)}")


def _bits(row: bytes, vocab_size: int) -> np.ndarray:
    _check(row, vocab_size)
    return np.unpackbits(np.frombuffer(row, dtype=np.uint8), bitorder="little").view(bool)


def shard_blocked(rows: list[bytes], vocab_start: int, local_valid: int, vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """bool [len(rows), local_valid] on ``device``: True where the grammar forbids the lane
    (global id vocab_start + lane)."""
    if vocab_start < 0 or vocab_start + local_valid > vocab_size:
        raise ValueError(f"shard [{vocab_start}, {vocab_start + local_valid}) outside the "
                         f"vocabulary of {vocab_size}")
    blocked = np.empty((len(rows), local_valid), dtype=bool)
    first, last = vocab_start // 32, -(-(vocab_start + local_valid) // 32)
    skip = vocab_start - 32 * first  # (the shard's first id within its first word)
    for i, row in enumerate(rows):
        _check(row, vocab_size)
        words = np.frombuffer(row, dtype=np.uint8)[4 * first:4 * last]  # (only the shard's)
        bits = np.unpackbits(words, bitorder="little").view(bool)
        np.logical_not(bits[skip:skip + local_valid], out=blocked[i])
    return torch.from_numpy(blocked).to(device)
