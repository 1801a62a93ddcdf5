"""A record's checks, and one emitted position checked and converted with list operations."""

from __future__ import annotations

from kernels.layout import CHOSEN_BITS, CHOSEN_ID, FIRST_PAIR
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


def decode_position(
    slot: int,
    position: int,
    token_id: int,
    ints: list[int],
    floats: list[float],
    lane: LaneExpectation,
    count: int,
    vocab_size: int,
) -> DecodedEntry:
    """One position's entry from its words read as ints and as floats, with ``count``
    alternatives (``lane.count``)."""
    chosen_id = ints[CHOSEN_ID]
    if chosen_id != token_id:
        raise DecodeError(
            slot, f"position {position}: payload chosen id {chosen_id}, emitted token {token_id}"
        )
    chosen = floats[CHOSEN_BITS]
    if chosen != chosen or chosen == _INF:
        raise DecodeError(
            slot, f"position {position}: chosen token {token_id}: non-finite logprob {chosen}"
        )
    end = FIRST_PAIR + 2 * count
    ids, values = ints[FIRST_PAIR:end:2], floats[FIRST_PAIR + 1 : end : 2]
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
