"""A record's checks, and one emitted position checked and converted with list operations."""

from __future__ import annotations

from typing import NamedTuple

from ranks.contract.abi6 import (
    EMITTED,
    EMITTING_KINDS,
    EPOCH,
    FORCED_MASK,
    HEADER,
    KIND,
    REQUEST_ORDINAL,
    SLOT,
    SUBMISSION,
    Kind,
)
from runtime.engine.client import TokenLogprobs
from runtime.engine.decoding.lanes import DecodedEntry, DecodeError, LaneExpectation

_KINDS = frozenset(int(kind) for kind in Kind)
_EMITTING = frozenset(int(kind) for kind in EMITTING_KINDS)
_INF = float("inf")


def emitting_positions(
    slot: int,
    header: list[int],
    token_capacity: int,
    copied_pairs: int,
    lane: LaneExpectation,
    submission: int | None,
) -> list[tuple[int, int]]:
    """The record's checks; (position, token id) of every emitted, unforced position."""
    found = (header[SLOT], header[EPOCH], header[REQUEST_ORDINAL])
    wanted = (slot, lane.epoch, lane.ordinal)
    if found != wanted:
        raise DecodeError(
            slot, f"stale record: (slot, epoch, ordinal) {found}, scheduler expects {wanted}"
        )
    if submission is not None and header[SUBMISSION] != submission:
        raise DecodeError(
            slot, f"stale record: submission {header[SUBMISSION]}, expected {submission}"
        )
    kind = header[KIND]
    if kind not in _KINDS:
        raise DecodeError(slot, f"record kind {kind} is not an ABI6 kind")
    if kind not in _EMITTING:
        return []
    emitted = header[EMITTED]
    if not 0 <= emitted <= token_capacity:
        raise DecodeError(slot, f"record emits {emitted} tokens, T={token_capacity}")
    if lane.pairs > copied_pairs:
        raise DecodeError(
            slot, f"payload prefix holds {copied_pairs} pairs, the request reads {lane.pairs}"
        )
    tokens = header[HEADER : HEADER + emitted]
    forced_mask = header[FORCED_MASK]
    if not forced_mask:
        return list(enumerate(tokens))
    return [(p, t) for p, t in enumerate(tokens) if not (forced_mask >> p) & 1]


class WordRow(NamedTuple):
    """One emitted position's copied words, read as Python values."""

    chosen_id: int
    chosen: float
    """The chosen token's FP32 logprob."""
    ids: list[int]
    """Alternative ids, as many as the frame copied (the lane takes its first count)."""
    values: list[float]
    """Their FP32 logprobs."""


def decode_position(
    slot: int,
    position: int,
    token_id: int,
    row: WordRow,
    lane: LaneExpectation,
    count: int,
    vocab_size: int,
) -> DecodedEntry:
    """One position's entry from its words, with ``count`` alternatives (``lane.count``)."""
    chosen_id, chosen = row.chosen_id, row.chosen
    if chosen_id != token_id:
        raise DecodeError(
            slot, f"position {position}: payload chosen id {chosen_id}, emitted token {token_id}"
        )
    if chosen != chosen or chosen == _INF:
        raise DecodeError(
            slot, f"position {position}: chosen token {token_id}: non-finite logprob {chosen}"
        )
    ids, values = row.ids, row.values
    if count < len(ids):
        ids, values = ids[:count], values[:count]
    if lane.token_ids is not None:
        if ids != list(lane.token_ids):
            missing = [(j, t) for j, t in enumerate(lane.token_ids) if ids[j] != t]
            raise DecodeError(slot, f"position {position}: selected ids missing or out of "
                                    f"order at (index, id) {missing[:4]}")
    elif ids and (min(ids) < 0 or max(ids) >= vocab_size):
        first = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise DecodeError(
            slot,
            f"position {position}: natural alternative {first} missing (id {ids[first]}), "
            f"expected {count} alternatives",
        )
    total = sum(values)  # NaN or +inf when any value is NaN or +inf (or finite ones overflow)
    if total != total or total == _INF:
        for value in values:
            if value != value or value == _INF:
                raise DecodeError(
                    slot, f"position {position}: alternatives: non-finite logprob {value}"
                )
    return tuple.__new__(DecodedEntry, (position, token_id, chosen, TokenLogprobs(ids, values)))
