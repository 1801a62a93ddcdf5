"""ABI6 completion record: int64 [16 + T] per slot. The only place record indices are spelled."""

from __future__ import annotations

import enum

import torch

SLOT = 0
EPOCH = 1
REQUEST_ORDINAL = 2
KIND = 3
EMITTED = 4
FORCED_MASK = 5
OFFERED = 6
ACCEPTED = 7
FINISH_REASON = 8
SEQUENCE_LENGTH = 9
SUBMISSION = 10
FIRST_LOGIT_ROW = 11
RESERVED = (12, 13, 14, 15)
HEADER = 16
"""Token slots start here: record[HEADER + i] is emitted position i."""


class Kind(enum.IntEnum):
    NONE = 0
    SAMPLE = 1
    SPECULATIVE = 2
    ADMISSION = 3
    MAINTENANCE = 4
    VISION = 5
    INVALID = 6
    SCORED_PREFILL = 7


EMITTING_KINDS = (Kind.SAMPLE, Kind.SPECULATIVE, Kind.SCORED_PREFILL)
"""Kinds whose records may emit tokens; every other kind writes records only."""


class FinishReason(enum.IntEnum):
    NONE = 0
    LENGTH = 1
    EOS = 2
    STOP_TOKEN = 3
    ABORT = 4


def record_width(token_capacity: int) -> int:
    return HEADER + token_capacity


def emitted_tokens(record: torch.Tensor) -> list[int]:
    """The emitted prefix of one record (a 1-D int64 tensor)."""
    count = int(record[EMITTED])
    return [int(t) for t in record[HEADER : HEADER + count]]


def is_forced(record: torch.Tensor, position: int) -> bool:
    return bool((int(record[FORCED_MASK]) >> position) & 1)
