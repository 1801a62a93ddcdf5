"""The commit writer: ABI6 records for one submission's active frame.

Token limits, EOS and stop-token clipping happen here, so every reader (the reduction, the
executor, the decoder) only has to look at the record's emitted count. Records are built as
Python rows and written into the frame in one copy per submission.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ranks import abi6
from ranks.plan import RequestSpec


@dataclass
class SlotState:
    """What every rank remembers about the request occupying a slot."""

    epoch: int
    spec: RequestSpec
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    length: int = 0
    """Tokens whose K/V are in the cache."""


class RecordBatch:
    """The records of one submission, written to the frame by ``flush``."""

    def __init__(self, width: int, submission: int) -> None:
        self.width = width
        self.submission = submission
        self.slots: list[int] = []
        self.rows: list[list[int]] = []

    def _row(self, slot: int, state: SlotState, kind: abi6.Kind) -> list[int]:
        row = [0] * self.width
        row[abi6.SLOT] = slot
        row[abi6.EPOCH] = state.epoch
        row[abi6.REQUEST_ORDINAL] = state.spec.ordinal
        row[abi6.KIND] = int(kind)
        row[abi6.SEQUENCE_LENGTH] = state.length
        row[abi6.SUBMISSION] = self.submission
        self.slots.append(slot)
        self.rows.append(row)
        return row

    def admission(self, slot: int, state: SlotState, scored: bool = False) -> None:
        """A prefill chunk that samples nothing: a record, no emitted token (kind scored
        prefill for a scored chunk, whose scores are in the prompt_logprobs frame)."""
        self._row(slot, state, abi6.Kind.SCORED_PREFILL if scored else abi6.Kind.ADMISSION)

    def sample(self, slot: int, state: SlotState, token: int, logit_row: int) -> bool:
        """Commit one ordinarily sampled token; returns whether it was emitted (stop tokens
        are not).

        ``logit_row`` is the row of this slot's sampled position in the logits the reduction
        reads. OFFERED and ACCEPTED stay zero: they count speculative proposals only.
        """
        row = self._row(slot, state, abi6.Kind.SAMPLE)
        row[abi6.FIRST_LOGIT_ROW] = logit_row
        row[abi6.HEADER] = token
        if token in state.spec.stop_token_ids:
            # The terminating token stays in the token slot for the coordinator to read, but
            # it is not emitted: it gets no logprob and no text.
            row[abi6.FINISH_REASON] = int(abi6.FinishReason.STOP_TOKEN)
            return False
        state.output.append(token)
        row[abi6.EMITTED] = 1
        if len(state.output) >= state.spec.max_tokens:
            row[abi6.FINISH_REASON] = int(abi6.FinishReason.LENGTH)
        return True

    def flush(self, records: torch.Tensor) -> None:
        """Clear the frame's records and write this submission's rows."""
        records.zero_()
        if self.slots:
            index = torch.tensor(self.slots, dtype=torch.int64, device=records.device)
            records[index] = torch.tensor(self.rows, dtype=records.dtype, device=records.device)
