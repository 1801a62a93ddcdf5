"""Decoding one frame's copied records and payload prefix into per-request logprob entries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np
import torch

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
from runtime.engine.client import EngineError, TokenLogprob

_KINDS = frozenset(int(kind) for kind in Kind)
FEW_POSITIONS = 2
"""Frames with at most this many emitting positions are decoded position by position."""
_EMITTING = frozenset(int(kind) for kind in EMITTING_KINDS)


class DecodeError(EngineError):
    """The payload cannot back a request's entries: that request fails, others continue."""

    def __init__(self, slot: int, message: str) -> None:
        super().__init__(f"slot {slot}: {message}")
        self.slot = slot
        self.message = message


@dataclass(frozen=True)
class LaneExpectation:
    """What the scheduler expects of a requesting slot's record in this frame."""

    epoch: int
    ordinal: int
    logprobs: int | None = None
    """N natural alternatives (ignored when token_ids is set)."""
    token_ids: tuple[int, ...] | None = None
    """Selected IDs in caller order; their count is the slot's uploaded count."""

    def __post_init__(self) -> None:
        if self.logprobs is None and self.token_ids is None:
            raise ValueError("a requesting lane needs logprobs or token_ids")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: expected >= 0, got {self.logprobs}")
        if self.token_ids is not None and (
            not isinstance(self.token_ids, tuple) or not self.token_ids
        ):
            raise ValueError(f"token_ids: expected a non-empty tuple, got {self.token_ids!r}")

    @property
    def pairs(self) -> int:
        """Alternative pairs this request reads from each position."""
        return len(self.token_ids) if self.token_ids is not None else int(self.logprobs or 0)


class DecodedEntry(NamedTuple):
    """(A named tuple: a frame builds one per emitted position, and a frozen dataclass costs
    about twice as much to construct.)"""

    position: int
    """Emitted position within this frame's record (the scheduler's generated order)."""
    token_id: int
    logprob: float
    """Exact FP32 value; -inf is preserved."""
    alternatives: tuple[TokenLogprob, ...]
    """Natural (id, logprob) pairs trimmed to N, or every selected ID in caller order."""


@dataclass(frozen=True)
class SlotDecode:
    slot: int
    entries: tuple[DecodedEntry, ...]
    """Entries before the first failure, in generated order."""
    error: DecodeError | None = None
    """Set when the request fails; its later tokens in this frame produce no entries."""

    @property
    def ok(self) -> bool:
        return self.error is None


def decode_frame(
    records: torch.Tensor | np.ndarray,
    payload: torch.Tensor | np.ndarray,
    expected: Mapping[int, LaneExpectation],
    vocab_size: int,
    *,
    submission: int | None = None,
) -> dict[int, SlotDecode]:
    """Decode the request mask's slots from one frame's host copy.

    records: int64 [capacity, 16+T]; payload: int32 [capacity, T, 2+2W], the chosen pair and
    the first W alternative pairs of each position. Slots outside `expected` are never read.
    Every position of the frame is checked with whole-array operations; a slot with any
    failing position is decoded again position by position, which names the first failure.
    """
    record_rows = _host_array(records, np.int64, "records")
    words = _host_array(payload, np.int32, "payload")
    if record_rows.ndim != 2 or record_rows.shape[1] <= HEADER:
        raise ValueError(f"records: expected [capacity, 16+T], got {list(record_rows.shape)}")
    capacity, token_capacity = record_rows.shape[0], record_rows.shape[1] - HEADER
    if (
        words.ndim != 3
        or words.shape[:2] != (capacity, token_capacity)
        or words.shape[2] < FIRST_PAIR
        or words.shape[2] % 2
    ):
        raise ValueError(
            f"payload: expected [{capacity}, {token_capacity}, 2+2W], got {list(words.shape)}"
        )
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
    results: dict[int, SlotDecode] = {}
    lanes: list[tuple[int, LaneExpectation, list[tuple[int, int]]]] = []
    order = sorted(expected)
    if order and not 0 <= order[0] <= order[-1] < capacity:
        bad = next(slot for slot in order if not 0 <= slot < capacity)
        raise ValueError(f"slot: expected 0..{capacity - 1}, got {bad}")
    rows = record_rows[order].tolist()
    for slot, record in zip(order, rows, strict=True):
        try:
            emitting = _emitting(slot, record, words[slot], expected[slot], submission)
        except DecodeError as error:
            results[slot] = SlotDecode(slot, (), error)
        else:
            lanes.append((slot, expected[slot], emitting))
    if sum(len(emitting) for _, _, emitting in lanes) <= FEW_POSITIONS:
        for slot, lane, emitting in lanes:  # (whole-array checks cost more than they save)
            results[slot] = _decode_slot(slot, words[slot], lane, emitting, vocab_size)
    elif lanes:
        _decode_lanes(words, lanes, vocab_size, results)
    return {slot: results[slot] for slot in sorted(results)}


def _host_array(values: torch.Tensor | np.ndarray, dtype: type, name: str) -> np.ndarray:
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name}: expected a {np.dtype(dtype)} array, got {array.dtype}")
    return array


def _decode_lanes(
    words: np.ndarray,
    lanes: list[tuple[int, LaneExpectation, list[tuple[int, int]]]],
    vocab_size: int,
    results: dict[int, SlotDecode],
) -> None:
    """Every emitting position of `lanes` checked and converted with whole-array operations."""
    slots, positions, tokens, counts, selected = [], [], [], [], []
    for slot, lane, emitting in lanes:
        count = len(lane.token_ids) if lane.token_ids is not None else min(lane.logprobs,
                                                                           vocab_size)
        for position, token_id in emitting:
            slots.append(slot)
            positions.append(position)
            tokens.append(token_id)
            counts.append(count)
            selected.append(lane.token_ids)
    block = words[slots, positions]
    width = max(counts, default=0)
    ids = block[:, FIRST_PAIR : FIRST_PAIR + 2 * width : 2]
    values = _fp32(block[:, FIRST_PAIR + 1 : FIRST_PAIR + 2 * width : 2])
    chosen = _fp32(block[:, CHOSEN_BITS])
    inside = np.arange(width) < np.asarray(counts)[:, None]
    wanted = np.full(ids.shape, -1, dtype=np.int64)
    natural = np.ones(len(slots), dtype=bool)
    for row, token_ids in enumerate(selected):
        if token_ids is not None:
            wanted[row, : len(token_ids)] = token_ids
            natural[row] = False
    wrong_id = np.where(natural[:, None], (ids < 0) | (ids >= vocab_size), ids != wanted)
    bad = (
        (block[:, CHOSEN_ID] != np.asarray(tokens))
        | np.isnan(chosen)
        | (chosen == np.inf)
        | ((wrong_id | np.isnan(values) | (values == np.inf)) & inside).any(axis=1)
    )
    failed = {slots[row] for row in np.flatnonzero(bad).tolist()}
    # Every (id, value) pair of the block in one pass; each entry then takes a slice.
    pairs = list(map(tuple.__new__, repeat(TokenLogprob),
                     zip(ids.ravel().tolist(), values.ravel().tolist(), strict=True)))
    chosen_values = chosen.tolist()
    row = 0
    for slot, lane, emitting in lanes:
        if slot in failed:
            results[slot] = _decode_slot(slot, words[slot], lane, emitting, vocab_size)
            row += len(emitting)
            continue
        entries = []
        for position, token_id in emitting:
            start = row * width
            entries.append(tuple.__new__(DecodedEntry, (
                position, token_id, chosen_values[row],
                tuple(pairs[start : start + counts[row]]))))
            row += 1
        results[slot] = SlotDecode(slot, tuple(entries))


def _emitting(
    slot: int,
    header: list[int],
    words: np.ndarray,
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
    token_capacity = words.shape[0]
    emitted = header[EMITTED]
    if not 0 <= emitted <= token_capacity:
        raise DecodeError(slot, f"record emits {emitted} tokens, T={token_capacity}")
    copied_pairs = (words.shape[1] - FIRST_PAIR) // 2
    if lane.pairs > copied_pairs:
        raise DecodeError(
            slot, f"payload prefix holds {copied_pairs} pairs, the request reads {lane.pairs}"
        )
    forced_mask = header[FORCED_MASK]
    tokens = header[HEADER : HEADER + emitted]
    return [(p, t) for p, t in enumerate(tokens) if not (forced_mask >> p) & 1]


def _decode_slot(
    slot: int,
    words: np.ndarray,
    lane: LaneExpectation,
    emitting: list[tuple[int, int]],
    vocab_size: int,
) -> SlotDecode:
    """One position at a time: the entries before the first failure, and that failure."""
    entries: list[DecodedEntry] = []
    try:
        for position, token_id in emitting:
            entries.append(
                _decode_position(slot, position, token_id, words[position], lane, vocab_size)
            )
    except DecodeError as error:
        return SlotDecode(slot, tuple(entries), error)
    return SlotDecode(slot, tuple(entries))


def _decode_position(
    slot: int,
    position: int,
    token_id: int,
    words: np.ndarray,
    lane: LaneExpectation,
    vocab_size: int,
) -> DecodedEntry:
    """One position's entry, checked with Python lists (a frame of one or two positions:
    a dozen numpy calls on 40 words cost more than the words themselves)."""
    where = f"position {position}"
    head = words[: FIRST_PAIR + 2 * lane.pairs]
    row = head.tolist()
    floats = _fp32(head).tolist()
    chosen_id = row[CHOSEN_ID]
    if chosen_id != token_id:
        raise DecodeError(slot, f"{where}: payload chosen id {chosen_id}, emitted token {token_id}")
    chosen = floats[CHOSEN_BITS]
    _check_floats(slot, f"{where}: chosen token {token_id}", (chosen,))
    ids, values = row[FIRST_PAIR::2], floats[FIRST_PAIR + 1 :: 2]
    if lane.token_ids is not None:
        if ids != list(lane.token_ids):
            missing = [(j, t) for j, t in enumerate(lane.token_ids) if ids[j] != t]
            raise DecodeError(
                slot, f"{where}: selected ids missing or out of order at (index, id) {missing[:4]}"
            )
    else:
        count = min(lane.pairs, vocab_size)
        ids, values = ids[:count], values[:count]
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            first = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise DecodeError(
                slot,
                f"{where}: natural alternative {first} missing (id {ids[first]}), "
                f"expected {count} alternatives",
            )
    _check_floats(slot, f"{where}: alternatives", values)
    return tuple.__new__(DecodedEntry, (
        position, token_id, chosen,
        tuple(map(tuple.__new__, repeat(TokenLogprob), zip(ids, values, strict=True)))))


def _fp32(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, dtype=np.int32).view(np.float32)


_INF = float("inf")


def _check_floats(slot: int, what: str, values: Sequence[float]) -> None:
    """NaN and +inf are refused (-inf is a logprob: an impossible token)."""
    for value in values:
        if value != value or value == _INF:
            raise DecodeError(slot, f"{what}: non-finite logprob {value}")
