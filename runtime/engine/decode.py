"""Decoding one frame's copied records and payload prefix into per-request logprob entries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
from runtime.engine.client import EngineError


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


@dataclass(frozen=True)
class DecodedEntry:
    position: int
    """Emitted position within this frame's record (the scheduler's generated order)."""
    token_id: int
    logprob: float
    """Exact FP32 value; -inf is preserved."""
    alternatives: tuple[tuple[int, float], ...]
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
    for slot in sorted(expected):
        if not 0 <= slot < capacity:
            raise ValueError(f"slot: expected 0..{capacity - 1}, got {slot}")
        entries: list[DecodedEntry] = []
        try:
            _decode_slot(
                slot,
                record_rows[slot],
                words[slot],
                expected[slot],
                vocab_size,
                submission,
                entries,
            )
        except DecodeError as error:
            results[slot] = SlotDecode(slot, tuple(entries), error)
        else:
            results[slot] = SlotDecode(slot, tuple(entries))
    return results


def _host_array(values: torch.Tensor | np.ndarray, dtype: type, name: str) -> np.ndarray:
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name}: expected a {np.dtype(dtype)} array, got {array.dtype}")
    return array


def _decode_slot(
    slot: int,
    record: np.ndarray,
    words: np.ndarray,
    lane: LaneExpectation,
    vocab_size: int,
    submission: int | None,
    entries: list[DecodedEntry],
) -> None:
    found = (int(record[SLOT]), int(record[EPOCH]), int(record[REQUEST_ORDINAL]))
    wanted = (slot, lane.epoch, lane.ordinal)
    if found != wanted:
        raise DecodeError(
            slot, f"stale record: (slot, epoch, ordinal) {found}, scheduler expects {wanted}"
        )
    if submission is not None and int(record[SUBMISSION]) != submission:
        raise DecodeError(
            slot, f"stale record: submission {int(record[SUBMISSION])}, expected {submission}"
        )
    try:
        kind = Kind(int(record[KIND]))
    except ValueError:
        raise DecodeError(slot, f"record kind {int(record[KIND])} is not an ABI6 kind") from None
    if kind not in EMITTING_KINDS:
        return
    token_capacity = words.shape[0]
    emitted = int(record[EMITTED])
    if not 0 <= emitted <= token_capacity:
        raise DecodeError(slot, f"record emits {emitted} tokens, T={token_capacity}")
    copied_pairs = (words.shape[1] - FIRST_PAIR) // 2
    if lane.pairs > copied_pairs:
        raise DecodeError(
            slot, f"payload prefix holds {copied_pairs} pairs, the request reads {lane.pairs}"
        )
    forced_mask = int(record[FORCED_MASK])
    for position in range(emitted):
        if (forced_mask >> position) & 1:
            continue
        token_id = int(record[HEADER + position])
        entries.append(
            _decode_position(slot, position, token_id, words[position], lane, vocab_size)
        )


def _decode_position(
    slot: int,
    position: int,
    token_id: int,
    words: np.ndarray,
    lane: LaneExpectation,
    vocab_size: int,
) -> DecodedEntry:
    where = f"position {position}"
    chosen_id = int(words[CHOSEN_ID])
    if chosen_id != token_id:
        raise DecodeError(slot, f"{where}: payload chosen id {chosen_id}, emitted token {token_id}")
    chosen = _fp32(words[CHOSEN_BITS : CHOSEN_BITS + 1])
    _check_values(slot, f"{where}: chosen token {token_id}", chosen)
    pairs = words[FIRST_PAIR : FIRST_PAIR + 2 * lane.pairs].reshape(-1, 2)
    ids = pairs[:, 0].tolist()
    if lane.token_ids is not None:
        if ids != list(lane.token_ids):
            missing = [(j, t) for j, t in enumerate(lane.token_ids) if ids[j] != t]
            raise DecodeError(
                slot, f"{where}: selected ids missing or out of order at (index, id) {missing[:4]}"
            )
    else:
        pairs = pairs[: min(lane.pairs, vocab_size)]
        ids = ids[: len(pairs)]
        missing = [j for j, t in enumerate(ids) if not 0 <= t < vocab_size]
        if missing:
            raise DecodeError(
                slot,
                f"{where}: natural alternative {missing[0]} missing (id {ids[missing[0]]}), "
                f"expected {len(pairs)} alternatives",
            )
    values = _fp32(pairs[:, 1])
    _check_values(slot, f"{where}: alternatives", values)
    return DecodedEntry(
        position=position,
        token_id=token_id,
        logprob=chosen.tolist()[0],
        alternatives=tuple(zip(ids, values.tolist(), strict=True)),
    )


def _fp32(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, dtype=np.int32).view(np.float32)


def _check_values(slot: int, what: str, values: np.ndarray) -> None:
    bad = np.isnan(values) | (values == np.inf)
    if bad.any():
        raise DecodeError(slot, f"{what}: non-finite logprob {values[bad][0]}")
