"""decode_frame: one frame's host copy -> each requesting slot's logprob entries.

One gather takes the words of every emitted, unforced position of the requesting lanes, and
``tolist`` calls turn their ids and FP32 values into Python lists; each position is then
checked and converted with list operations (position.py). On a frame of 16 lanes x 20
alternatives, this costs less than the two dozen whole-array operations that the same checks
need in numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from helios_logprobs.kernels.layout import CHOSEN_BITS, CHOSEN_ID, FIRST_PAIR
from helios_logprobs.ranks.contract.abi6 import HEADER
from helios_logprobs.runtime.engine.decoding.lanes import DecodeError, LaneExpectation, SlotDecode
from helios_logprobs.runtime.engine.decoding.position import (
    WordRow,
    decode_lane,
    emitting_positions,
)

FEW_ROWS = 2
"""Frames of at most this many emitted positions gather them slice by slice."""


def decode_frame(
    records: torch.Tensor | np.ndarray,
    payload: torch.Tensor | np.ndarray,
    expected: Mapping[int, LaneExpectation],
    vocab_size: int,
    *,
    submission: int | None = None,
) -> dict[int, SlotDecode]:
    """Decode the request mask's slots from one frame's host copy, keyed by slot in order.

    records: int64 [capacity, 16+T]; payload: int32 [capacity, T, 2+2W], the chosen pair and
    the first W alternative pairs of each position. Slots outside `expected` are never read.
    A record of another slot, epoch, request or submission, an unknown kind, an emitted count
    past T, a request reading past the copied prefix, a chosen id other than the emitted
    token, a NaN or +inf value, or a missing or misplaced alternative fails that slot only;
    its entries before the first failing position are kept.
    """
    record_rows, words = _checked_arrays(records, payload, vocab_size)
    order = sorted(expected)
    if order and not 0 <= order[0] <= order[-1] < record_rows.shape[0]:
        bad = next(slot for slot in order if not 0 <= slot < record_rows.shape[0])
        raise ValueError(f"slot: expected 0..{record_rows.shape[0] - 1}, got {bad}")
    results: dict[int, SlotDecode] = {}
    lanes, slots, positions, pairs = _emitting_lanes(record_rows, words.shape, order, expected,
                                                     submission, results)
    rows = _gather(words, slots, positions, pairs)
    row = 0
    for slot, lane, emitting in lanes:
        results[slot] = decode_lane(slot, lane, emitting, rows, row, vocab_size)
        row += len(emitting)
    return results if len(lanes) == len(order) else {slot: results[slot] for slot in order}


def _checked_arrays(
    records: torch.Tensor | np.ndarray, payload: torch.Tensor | np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The records and payload as numpy arrays of one frame's shapes (ValueError else)."""
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
    return record_rows, words


def _emitting_lanes(
    record_rows: np.ndarray,
    shape: tuple[int, ...],
    order: list[int],
    expected: Mapping[int, LaneExpectation],
    submission: int | None,
    results: dict[int, SlotDecode],
) -> tuple[list[tuple[int, LaneExpectation, list[tuple[int, int]]]], list[int], list[int], int]:
    """(slot, lane, emitted positions) of every lane whose record passes its checks, in slot
    order, and the (slot, position) of every emitted position with the most pairs a lane
    reads: what the gather takes. A lane that fails its record checks gets its SlotDecode in
    ``results``."""
    headers = ([record_rows[slot].tolist() for slot in order] if len(order) <= FEW_ROWS
               else record_rows[order].tolist())
    copied_pairs = (shape[2] - FIRST_PAIR) // 2
    lanes = []
    slots: list[int] = []
    positions: list[int] = []
    pairs = 0
    for slot, header in zip(order, headers, strict=True):
        lane = expected[slot]
        try:
            emitting = emitting_positions(slot, header, shape[1], copied_pairs, lane, submission)
        except DecodeError as error:
            results[slot] = SlotDecode(slot, (), error)
            continue
        lanes.append((slot, lane, emitting))
        if len(emitting) == 1:
            slots.append(slot)
            positions.append(emitting[0][0])
        else:
            slots += [slot] * len(emitting)
            positions += [position for position, _ in emitting]
        if emitting and lane.pairs > pairs:
            pairs = lane.pairs
    return lanes, slots, positions, pairs


def _gather(words: np.ndarray, slots: list[int], positions: list[int], pairs: int) -> list[WordRow]:
    """Each (slot, position)'s chosen pair and first ``pairs`` alternative pairs, as Python
    values. A few rows are read one by one (an advanced index costs more), each word both as
    an int and as a float (four numpy calls); more rows are gathered once and each column is
    converted the one way it is read (half the objects)."""
    end = FIRST_PAIR + 2 * pairs
    if len(slots) <= FEW_ROWS:
        rows = []
        for slot, position in zip(slots, positions, strict=True):
            row = words[slot, position, :end]
            ints, floats = row.tolist(), row.view(np.float32).tolist()
            rows.append((ints[CHOSEN_ID], floats[CHOSEN_BITS], ints[FIRST_PAIR::2],
                         floats[FIRST_PAIR + 1 :: 2]))
        return rows
    block = words[slots, positions, :end]
    return list(zip(block[:, CHOSEN_ID].tolist(),
                    block[:, CHOSEN_BITS].view(np.float32).tolist(),
                    block[:, FIRST_PAIR::2].tolist(),
                    block[:, FIRST_PAIR + 1 :: 2].view(np.float32).tolist(), strict=True))


def _host_array(values: torch.Tensor | np.ndarray, dtype: type, name: str) -> np.ndarray:
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name}: expected a {np.dtype(dtype)} array, got {array.dtype}")
    return array
