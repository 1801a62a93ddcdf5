"""The commit writer: ABI6 records for one submission's active frame.

Token limits, EOS and stop-token clipping happen here, so every reader (the reduction, the
executor, the decoder) only has to look at the record's emitted count.
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


@dataclass(frozen=True)
class CommitResult:
    emitted: int
    finish: abi6.FinishReason


def write_header(
    record: torch.Tensor, slot: int, state: SlotState, kind: abi6.Kind, submission: int
) -> None:
    record.zero_()
    record[abi6.SLOT] = slot
    record[abi6.EPOCH] = state.epoch
    record[abi6.REQUEST_ORDINAL] = state.spec.ordinal
    record[abi6.KIND] = int(kind)
    record[abi6.SEQUENCE_LENGTH] = state.length
    record[abi6.SUBMISSION] = submission


def commit_admission(record: torch.Tensor, slot: int, state: SlotState, submission: int) -> None:
    """A prefill chunk that samples nothing: a record, no emitted token."""
    write_header(record, slot, state, abi6.Kind.ADMISSION, submission)


def commit_sample(
    record: torch.Tensor,
    slot: int,
    state: SlotState,
    token: int,
    submission: int,
    logit_row: int,
) -> CommitResult:
    """Commit one sampled token: emit it, or clip it when it is a stop token."""
    write_header(record, slot, state, abi6.Kind.SAMPLE, submission)
    record[abi6.FIRST_LOGIT_ROW] = logit_row
    record[abi6.OFFERED] = 1
    record[abi6.HEADER] = token
    if token in state.spec.stop_token_ids:
        # The terminating token stays in the token slot for the coordinator to read, but it is
        # not emitted: it gets no logprob and no text.
        record[abi6.FINISH_REASON] = int(abi6.FinishReason.STOP_TOKEN)
        return CommitResult(0, abi6.FinishReason.STOP_TOKEN)
    state.output.append(token)
    record[abi6.EMITTED] = 1
    record[abi6.ACCEPTED] = 1
    finish = abi6.FinishReason.NONE
    if len(state.output) >= state.spec.max_tokens:
        finish = abi6.FinishReason.LENGTH
    record[abi6.FINISH_REASON] = int(finish)
    return CommitResult(1, finish)
