"""The coordinator's side of prompt scoring: copy a submission's scored rows into
preallocated host storage after the producing step, decode them, then release the frame.

Row j of a scored chunk starting at prompt position s scores the prompt token at s + j + 1
(kernels/scoring.py has the row layout); the row at the prompt end (target -1) has no entry,
and position 0 never has one. A row whose id is not the expected prompt token, whose value is
NaN or +inf, or that lacks one of its min(top_n, vocabulary) alternatives fails its request
instead of losing an entry.
"""

from __future__ import annotations

from typing import NamedTuple

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

    def read(self, frame: int, work: SlotWork, top_n: int) -> PromptArrays:
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
        return prompt_arrays(host.numpy(), work, top_n, self.scorer.model.vocab_size)


class PromptArrays(NamedTuple):
    """A scored chunk's entries as parallel arrays (prompt order), alternatives flattened in
    row order, FP32 values as the rows' bits."""

    positions: np.ndarray
    """int64: the scored token's index in the prompt."""
    token_ids: np.ndarray
    """int32."""
    values: np.ndarray
    """float32."""
    ranks: np.ndarray
    """int64."""
    alt_counts: np.ndarray
    """int32."""
    alt_ids: np.ndarray
    """int32."""
    alt_values: np.ndarray
    """float32."""

    def entries(self) -> tuple[PromptLogprob, ...]:
        """As PromptLogprob objects (an in-process consumer, the API server, tests)."""
        ids, values = self.alt_ids.tolist(), self.alt_values.tolist()
        entries = []
        start = 0
        for position, token_id, value, rank, count in zip(
                self.positions.tolist(), self.token_ids.tolist(), self.values.tolist(),
                self.ranks.tolist(), self.alt_counts.tolist(), strict=True):
            alternatives = tuple(map(TokenLogprob, ids[start:start + count],
                                     values[start:start + count]))
            start += count
            entries.append(PromptLogprob(position, token_id, value, rank, alternatives))
        return tuple(entries)


def decode_prompt_rows(
    rows: np.ndarray, work: SlotWork, top_n: int, vocab_size: int
) -> tuple[PromptLogprob, ...]:
    """``prompt_arrays``' entries as objects."""
    return prompt_arrays(rows, work, top_n, vocab_size).entries()


def prompt_arrays(rows: np.ndarray, work: SlotWork, top_n: int, vocab_size: int) -> PromptArrays:
    """The chunk's entries (rows whose target is a prompt token); EngineError names the first
    row that cannot back its entry."""
    targets = np.asarray(work.targets, dtype=np.int64)
    scored = np.flatnonzero(targets >= 0)
    picked = rows[scored]
    ids = picked[:, PROMPT_TARGET_ID]
    values = picked[:, PROMPT_TARGET_BITS].view(np.float32)
    count = min(top_n, vocab_size)  # (a vocabulary below K leaves the last ids at -1)
    pairs = picked[:, PROMPT_FIRST_PAIR:].reshape(-1, PROMPT_K, 2)[:, :count]
    alt_ids = pairs[:, :, 0]
    alt_values = pairs[:, :, 1].view(np.float32)
    # (x < inf is False for NaN and +inf alone; an id below 0 is a large unsigned one)
    good = ((ids == targets[scored]) & (values < np.inf)
            & (alt_ids.view(np.uint32) < vocab_size).all(axis=1)
            & (alt_values < np.inf).all(axis=1))
    if not good.all():
        j = int(scored[np.argmin(good)])
        raise EngineError(_row_error(rows, j, work, count, vocab_size))
    n = len(scored)
    return PromptArrays(scored + work.start + 1, ids.astype(np.int32), values.copy(),
                        picked[:, PROMPT_RANK].astype(np.int64),
                        np.full(n, count, dtype=np.int32), alt_ids.reshape(-1).copy(),
                        alt_values.reshape(-1).copy())


def _row_error(rows: np.ndarray, j: int, work: SlotWork, count: int, vocab_size: int) -> str:
    """Why row ``j`` cannot back its entry (its first failing check)."""
    where = f"slot {work.slot}: prompt position {work.start + j + 1}"
    scored_id = int(rows[j, PROMPT_TARGET_ID])
    if scored_id != work.targets[j]:
        return f"{where}: scored id {scored_id}, prompt token {work.targets[j]}"
    value = float(rows[j, PROMPT_TARGET_BITS:PROMPT_TARGET_BITS + 1].view(np.float32)[0])
    if np.isnan(value) or value == np.inf:
        return f"{where}: non-finite logprob {value}"
    pairs = rows[j, PROMPT_FIRST_PAIR:].reshape(PROMPT_K, 2)[:count]
    if count and not (pairs[:, 0].min() >= 0 and pairs[:, 0].max() < vocab_size):
        return (f"{where}: alternative ids {pairs[:, 0].tolist()} outside the vocabulary of "
                f"{vocab_size}")
    return f"{where}: non-finite alternative logprob"
