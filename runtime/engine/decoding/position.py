"""A record's checks, and why one position's words cannot back its entry (the frame's checks
run on arrays, frame.py; this names the first failure of a lane)."""

from __future__ import annotations

from helios_logprobs.ranks.contract.abi6 import (
    EMITTED,
    EMITTING_KINDS,
    EPOCH,
    FORCED_MASK,
    KIND,
    REQUEST_ORDINAL,
    SLOT,
    SUBMISSION,
    Kind,
)
from helios_logprobs.runtime.engine.decoding.lanes import DecodeError, LaneExpectation

_KINDS = frozenset(int(kind) for kind in Kind)
_EMITTING = frozenset(int(kind) for kind in EMITTING_KINDS)
_INF = float("inf")


def checked_header(
    slot: int,
    header: list[int],
    token_capacity: int,
    copied_pairs: int,
    lane: LaneExpectation,
    submission: int | None,
) -> tuple[int, int]:
    """The record's checks (DecodeError); (emitted count, forced mask) of a record that
    emits, (0, 0) of a record-only round."""
    emitted = header[EMITTED]
    if (  # the usual record, in one test; any failure is named below
        header[SLOT] == slot and header[EPOCH] == lane.epoch
        and header[REQUEST_ORDINAL] == lane.ordinal
        and (submission is None or header[SUBMISSION] == submission)
        and header[KIND] in _EMITTING and 0 <= emitted <= token_capacity
        and lane.pairs <= copied_pairs
    ):
        return emitted, header[FORCED_MASK]
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
        return 0, 0
    if not 0 <= emitted <= token_capacity:
        raise DecodeError(slot, f"record emits {emitted} tokens, T={token_capacity}")
    raise DecodeError(
        slot, f"payload prefix holds {copied_pairs} pairs, the request reads {lane.pairs}"
    )


WordRow = tuple[int, float, list[int], list[float]]
"""One emitted position's copied words as Python values: the chosen id, its FP32 logprob, and
the alternative ids and their FP32 logprobs, as many as the frame copied (the lane takes its
first count). A plain tuple: a named one costs a Python-level __new__ per position."""


def position_error(
    slot: int,
    position: int,
    token_id: int,
    words: WordRow,
    lane: LaneExpectation,
    count: int,
    vocab_size: int,
) -> DecodeError | None:
    """Why one position's words cannot back its entry (the first failing check), or None."""
    chosen_id, chosen, ids, values = words
    if chosen_id != token_id:
        return DecodeError(
            slot, f"position {position}: payload chosen id {chosen_id}, emitted token {token_id}"
        )
    if chosen != chosen or chosen == _INF:
        return DecodeError(
            slot, f"position {position}: chosen token {token_id}: non-finite logprob {chosen}"
        )
    ids, values = ids[:count], values[:count]
    if lane.token_ids is not None:
        if ids != list(lane.token_ids):
            missing = [(j, t) for j, t in enumerate(lane.token_ids) if ids[j] != t]
            return DecodeError(slot, f"position {position}: selected ids missing or out of "
                                     f"order at (index, id) {missing[:4]}")
    elif ids and (min(ids) < 0 or max(ids) >= vocab_size):
        first = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
        return DecodeError(
            slot,
            f"position {position}: natural alternative {first} missing (id {ids[first]}), "
            f"expected {count} alternatives",
        )
    for value in values:
        if value != value or value == _INF:
            return DecodeError(
                slot, f"position {position}: alternatives: non-finite logprob {value}"
            )
    return None
