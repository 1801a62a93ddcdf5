"""A record's checks, and one lane's emitted positions checked and converted with list
operations."""

from __future__ import annotations

from helios_logprobs.ranks.contract.abi6 import (
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
from helios_logprobs.runtime.engine.decoding.lanes import (
    DecodedEntry,
    DecodeError,
    LaneExpectation,
    SlotDecode,
)
from helios_logprobs.runtime.outputs import TokenLogprobs

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
    emitted = header[EMITTED]
    if (  # the usual record, in one test; any failure is named below
        header[SLOT] == slot and header[EPOCH] == lane.epoch
        and header[REQUEST_ORDINAL] == lane.ordinal
        and (submission is None or header[SUBMISSION] == submission)
        and header[KIND] in _EMITTING and 0 <= emitted <= token_capacity
        and lane.pairs <= copied_pairs and not header[FORCED_MASK]
    ):
        return list(enumerate(header[HEADER : HEADER + emitted]))
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
    if not 0 <= emitted <= token_capacity:
        raise DecodeError(slot, f"record emits {emitted} tokens, T={token_capacity}")
    if lane.pairs > copied_pairs:
        raise DecodeError(
            slot, f"payload prefix holds {copied_pairs} pairs, the request reads {lane.pairs}"
        )
    forced_mask = header[FORCED_MASK]
    tokens = header[HEADER : HEADER + emitted]
    return [(p, t) for p, t in enumerate(tokens) if not (forced_mask >> p) & 1]


WordRow = tuple[int, float, list[int], list[float]]
"""One emitted position's copied words as Python values: the chosen id, its FP32 logprob, and
the alternative ids and their FP32 logprobs, as many as the frame copied (the lane takes its
first count). A plain tuple: a named one costs a Python-level __new__ per position."""


def decode_lane(
    slot: int,
    lane: LaneExpectation,
    emitting: list[tuple[int, int]],
    rows: list[WordRow],
    row: int,
    vocab_size: int,
) -> SlotDecode:
    """A lane's entries from ``rows[row]`` on, one per emitted position: the entries before
    the first failing position, and that failure. A position passes when its chosen id is the
    emitted token, its alternatives are the selected ids (or natural ids in the vocabulary),
    and no value is NaN or +inf; a position that fails that test is named by position_error."""
    count = lane.count(vocab_size)
    selected = lane.selected
    entries: list[DecodedEntry] = []
    for position, token_id in emitting:
        words = rows[row]
        row += 1
        chosen_id, chosen, ids, values = words
        if count < len(ids):
            ids, values = ids[:count], values[:count]
        total = chosen + sum(values)  # NaN or +inf when a value is (or finite ones overflow)
        if (
            chosen_id != token_id or total != total or total == _INF
            or (ids != selected if selected is not None
                else ids and (min(ids) < 0 or max(ids) >= vocab_size))
        ):
            error = position_error(slot, position, token_id, words, lane, count, vocab_size)
            if error is not None:
                return SlotDecode(slot, tuple(entries), error)
        entries.append(tuple.__new__(DecodedEntry, (position, token_id, chosen,
                                                    TokenLogprobs(ids, values))))
    return tuple.__new__(SlotDecode, (slot, tuple(entries), None))


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
