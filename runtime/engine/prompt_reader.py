"""The coordinator's side of prompt scoring: copy a submission's scored rows into
preallocated host storage after the producing step, decode them, then release the frame.

Row j of a scored chunk starting at prompt position s scores the prompt token at s + j + 1
(kernels/scoring.py has the row layout); the row at the prompt end (target -1) has no entry,
and position 0 never has one. A row whose id is not the expected prompt token, whose value is
NaN or +inf, or that lacks one of its min(top_n, vocabulary) alternatives fails its request
instead of losing an entry.
"""

from __future__ import annotations

import numpy as np
import torch

from helios_logprobs.kernels.layout import (
    PROMPT_FIRST_PAIR,
    PROMPT_K,
    PROMPT_RANK,
    PROMPT_ROW_WORDS,
    PROMPT_TARGET_BITS,
    PROMPT_TARGET_ID,
)
from helios_logprobs.ranks.plan import SlotWork
from helios_logprobs.ranks.step.scoring import PromptScorer
from helios_logprobs.runtime.outputs import EngineError, PromptLogprob, TokenLogprob


class PromptReader:
    def __init__(self, scorer: PromptScorer) -> None:
        self.scorer = scorer
        largest = scorer.ladder[-1].prompt_logprobs
        self.host = torch.empty(largest.shape[1], PROMPT_ROW_WORDS, dtype=torch.int32,
                                pin_memory=largest.is_cuda)
        self.rows_copied = 0
        self.bytes_copied = 0

    def read(self, frame: int, work: SlotWork, top_n: int) -> tuple[PromptLogprob, ...]:
        """The entries of ``work``'s scored chunk, computed by the last step in ``frame``."""
        last = self.scorer.last
        n = len(work.targets)
        if last is None or last[1] != n:
            raise EngineError(f"slot {work.slot}: the step left no scored rows for this chunk")
        source = self.scorer.frames_for(n).prompt_logprobs[frame, :n]
        host = self.host[:n]
        host.copy_(source)
        self.rows_copied += n
        self.bytes_copied += host.numel() * host.element_size()
        return decode_prompt_rows(host.numpy(), work, top_n, self.scorer.model.vocab_size)


def decode_prompt_rows(
    rows: np.ndarray, work: SlotWork, top_n: int, vocab_size: int
) -> tuple[PromptLogprob, ...]:
    ids = rows[:, PROMPT_TARGET_ID]
    values = np.ascontiguousarray(rows[:, PROMPT_TARGET_BITS]).view(np.float32)
    ranks = rows[:, PROMPT_RANK]
    pairs = rows[:, PROMPT_FIRST_PAIR:].reshape(-1, PROMPT_K, 2)
    count = min(top_n, vocab_size)  # (a vocabulary below K leaves the last ids at -1)
    alt_ids = pairs[:, :count, 0]
    alt_values = np.ascontiguousarray(pairs[:, :count, 1]).view(np.float32)
    entries = []
    for j, target in enumerate(work.targets):
        if target < 0:
            continue
        position = work.start + j + 1
        where = f"slot {work.slot}: prompt position {position}"
        if int(ids[j]) != target:
            raise EngineError(f"{where}: scored id {int(ids[j])}, prompt token {target}")
        value = float(values[j])
        if np.isnan(value) or value == np.inf:
            raise EngineError(f"{where}: non-finite logprob {value}")
        if count and not (alt_ids[j].min() >= 0 and alt_ids[j].max() < vocab_size):
            raise EngineError(f"{where}: alternative ids {alt_ids[j].tolist()} outside the "
                              f"vocabulary of {vocab_size}")
        alternatives = tuple(
            TokenLogprob(t, v) for t, v in zip(alt_ids[j].tolist(), alt_values[j].tolist(),
                                               strict=True)
        )
        if any(np.isnan(v) or v == np.inf for _, v in alternatives):
            raise EngineError(f"{where}: non-finite alternative logprob")
        entries.append(PromptLogprob(position, target, value, int(ranks[j]), alternatives))
    return tuple(entries)
