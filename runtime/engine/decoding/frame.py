"""decode_frame: one frame's host copy -> each requesting slot's logprob entries, as arrays.

One gather takes the words of every emitted, unforced position of the requesting lanes; the
checks (chosen id = emitted token, no NaN or +inf, natural ids in the vocabulary or the
selected ids in caller order) run as whole-array operations over that block, and the entries
stay arrays: FP32 values as the frame's bits, alternatives flattened (``alt_counts`` per row).
Nothing per position is built in Python unless a lane fails (its error names the position,
position.py) or a caller asks for objects (``FrameDecode.slot_decodes``: tests, scripts).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.kernels.layout import CHOSEN_BITS, CHOSEN_ID, FIRST_PAIR
from helios_logprobs.ranks.contract.abi6 import HEADER
from helios_logprobs.runtime.engine.decoding.lanes import (
    DecodedEntry,
    DecodeError,
    LaneExpectation,
    LaneRows,
    SlotDecode,
)
from helios_logprobs.runtime.engine.decoding.position import checked_header, position_error
from helios_logprobs.runtime.outputs import TokenLogprobs

_EMPTY_INT = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class FrameDecode:
    """Every decoded row (an emitted, unforced position of a lane that passed its record
    checks), lanes in slot order, each lane's rows in emitted order. A lane's rows from
    ``LaneRows.good`` on are not entries (its error names the first)."""

    lanes: dict[int, LaneRows]
    slots: np.ndarray
    """int64 [rows]: the row's slot."""
    positions: np.ndarray
    """int64 [rows]: emitted position within the record."""
    token_ids: np.ndarray
    """int32 [rows]: the emitted (and chosen) token."""
    values: np.ndarray
    """float32 [rows]: the chosen token's exact FP32 logprob."""
    alt_counts: np.ndarray
    """int32 [rows]: alternatives the row reports."""
    alt_offsets: np.ndarray
    """int64 [rows + 1]: row r's alternatives are alt_ids[alt_offsets[r]:alt_offsets[r+1]]."""
    alt_ids: np.ndarray
    alt_values: np.ndarray
    """float32, exact FP32."""

    def slot_decodes(self) -> dict[int, SlotDecode]:
        """The entries as objects, keyed by slot in slot order (tests, scripts)."""
        positions, token_ids = self.positions.tolist(), self.token_ids.tolist()
        values, offsets = self.values.tolist(), self.alt_offsets.tolist()
        alt_ids, alt_values = self.alt_ids.tolist(), self.alt_values.tolist()
        results = {}
        for slot, lane in self.lanes.items():
            entries = tuple(
                DecodedEntry(positions[r], token_ids[r], values[r], TokenLogprobs(
                    alt_ids[offsets[r]:offsets[r + 1]], alt_values[offsets[r]:offsets[r + 1]]))
                for r in range(lane.start, lane.good))
            results[slot] = SlotDecode(slot, entries, lane.error)
        return results


def decode_frame(
    records: torch.Tensor | np.ndarray,
    payload: torch.Tensor | np.ndarray,
    expected: Mapping[int, LaneExpectation],
    vocab_size: int,
    *,
    submission: int | None = None,
) -> dict[int, SlotDecode]:
    """``decode_arrays``' entries as objects, keyed by slot in order."""
    return decode_arrays(records, payload, expected, vocab_size,
                         submission=submission).slot_decodes()


def decode_arrays(
    records: torch.Tensor | np.ndarray,
    payload: torch.Tensor | np.ndarray,
    expected: Mapping[int, LaneExpectation],
    vocab_size: int,
    *,
    submission: int | None = None,
    headers: list[list[int]] | None = None,
) -> FrameDecode:
    """Decode the request mask's slots from one frame's host copy.

    records: int64 [capacity, 16+T]; payload: int32 [capacity, T, 2+2W], the chosen pair and
    the first W alternative pairs of each position. Slots outside `expected` are never read.
    A record of another slot, epoch, request or submission, an unknown kind, an emitted count
    past T, a request reading past the copied prefix, a chosen id other than the emitted
    token, a NaN or +inf value, or a missing or misplaced alternative fails that slot only;
    its entries before the first failing position are kept. ``headers``: the records of the
    expected slots in slot order as lists, when the caller read them already.
    """
    record_rows, words = _checked_arrays(records, payload, vocab_size)
    order = sorted(expected)
    if order and not 0 <= order[0] <= order[-1] < record_rows.shape[0]:
        bad = next(slot for slot in order if not 0 <= slot < record_rows.shape[0])
        raise ValueError(f"slot: expected 0..{record_rows.shape[0] - 1}, got {bad}")
    if headers is None:
        headers = record_rows[order].tolist()
    copied_pairs = (words.shape[2] - FIRST_PAIR) // 2
    lanes: list[tuple[int, LaneExpectation, int, int]] = []  # (slot, lane, emitted, forced)
    failed: dict[int, DecodeError] = {}
    for slot, header in zip(order, headers, strict=True):
        lane = expected[slot]
        try:
            emitted, forced = checked_header(slot, header, words.shape[1], copied_pairs, lane,
                                             submission)
        except DecodeError as error:
            failed[slot] = error
            continue
        lanes.append((slot, lane, emitted, forced))
    rows = _emitted_rows(lanes)
    per_lane = _rows_per_lane(lanes)
    block = _checked_block(record_rows, words, lanes, rows, per_lane, vocab_size)
    return _frame_decode(order, lanes, failed, rows, per_lane, block, vocab_size)


def _emitted_rows(lanes: list[tuple[int, LaneExpectation, int, int]]) -> tuple[np.ndarray, ...]:
    """(slot, position, lane index) of every emitted, unforced position, lanes in order."""
    if not lanes:
        return _EMPTY_INT, _EMPTY_INT, _EMPTY_INT
    slots = np.array([lane[0] for lane in lanes], dtype=np.int64)
    emitted = [lane[2] for lane in lanes]
    forced = [lane[3] for lane in lanes]
    if not any(forced) and emitted.count(1) == len(lanes):  # (an ordinary decode step)
        return slots, np.zeros(len(lanes), dtype=np.int64), np.arange(len(lanes))
    emitted_array = np.array(emitted, dtype=np.int64)
    lane_index = np.repeat(np.arange(len(lanes)), emitted_array)
    positions = np.arange(len(lane_index)) - np.repeat(np.cumsum(emitted_array) - emitted_array,
                                                       emitted_array)
    if any(forced):  # (a forced position has no entry)
        kept = (np.repeat(np.array(forced, dtype=np.int64), emitted_array) >> positions) & 1 == 0
        lane_index, positions = lane_index[kept], positions[kept]
    return slots[lane_index], positions, lane_index


def _rows_per_lane(lanes: list[tuple[int, LaneExpectation, int, int]]) -> list[int]:
    """Each lane's decoded rows: its emitted positions less the forced ones."""
    return [emitted - (forced & ((1 << emitted) - 1)).bit_count()
            for _, _, emitted, forced in lanes]


@dataclass(frozen=True)
class _Block:
    token_ids: np.ndarray
    chosen_ids: np.ndarray
    chosen: np.ndarray
    ids: np.ndarray
    """int32 [rows, pairs]: every row's first ``pairs`` alternative ids (the most any lane
    reads); ``wanted`` marks the ones a row reports."""
    values: np.ndarray
    wanted: np.ndarray | None
    """bool [rows, pairs], or None when every row reports all ``pairs``."""
    counts: np.ndarray
    offsets: np.ndarray
    bad: np.ndarray | None
    """bool [rows]: the row fails one of its checks (None: no row does)."""


def _checked_block(record_rows, words, lanes, rows, per_lane, vocab_size) -> _Block:
    slots, positions, lane_index = rows
    n = len(positions)
    counts_by_lane = [lane.count(vocab_size) for _, lane, _, _ in lanes]
    pairs = max((lane.pairs for _, lane, _, _ in lanes), default=0)
    block = words[slots, positions, :FIRST_PAIR + 2 * pairs]
    token_ids = record_rows[slots, HEADER + positions].astype(np.int32)
    chosen_ids = block[:, CHOSEN_ID]
    chosen = block[:, CHOSEN_BITS].view(np.float32)
    ids = block[:, FIRST_PAIR::2]
    values = block[:, FIRST_PAIR + 1 :: 2].view(np.float32)
    if min(counts_by_lane, default=pairs) == pairs:  # (every row reports every pair read)
        wanted = None
        counts = np.full(n, pairs, dtype=np.int32)
        offsets = (np.arange(0, (n + 1) * pairs, pairs, dtype=np.int64) if pairs
                   else np.zeros(n + 1, dtype=np.int64))
    else:
        counts = np.repeat(np.array(counts_by_lane, dtype=np.int32), per_lane)
        wanted = np.arange(ids.shape[1]) < counts[:, None]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
    # (x < inf is False for NaN and +inf alone; an id below 0 is a large unsigned one)
    fine = (values < np.inf) & (ids.view(np.uint32) < vocab_size)
    selected = [i for i, (_, lane, _, _) in enumerate(lanes) if lane.selected is not None]
    if selected:  # the selected ids in caller order, each lane's own
        expected = np.full((len(lanes), ids.shape[1]), -1, dtype=np.int32)
        for i in selected:
            expected[i, :lanes[i][1].pairs] = lanes[i][1].selected
        natural = np.ones(len(lanes), dtype=bool)
        natural[selected] = False
        fine &= natural[lane_index][:, None] | (ids == expected[lane_index])
    if wanted is not None:
        fine |= ~wanted
    good = (chosen_ids == token_ids) & (chosen < np.inf) & fine.all(axis=1)
    bad = None if good.all() else ~good
    return _Block(token_ids, chosen_ids, chosen, ids, values, wanted, counts, offsets, bad)


def _frame_decode(order, lanes, failed, rows, per_lane, block: _Block,
                  vocab_size: int) -> FrameDecode:
    slots, positions, lane_index = rows
    stops = list(itertools.accumulate(per_lane))
    by_slot = dict(zip([lane[0] for lane in lanes], map(LaneRows, [0, *stops[:-1]], stops,
                                                         stops), strict=True))
    if block.bad is not None:  # (rare: a lane's first failing row ends its entries)
        for row in np.flatnonzero(block.bad).tolist():
            i = int(lane_index[row])
            slot, lane = lanes[i][0], lanes[i][1]
            if by_slot[slot].error is None:
                error = _row_error(slot, lane, block, positions, row, vocab_size)
                if error is not None:
                    by_slot[slot] = by_slot[slot]._replace(good=row, error=error)
    if failed:
        start = len(positions)
        for slot, error in failed.items():
            by_slot[slot] = LaneRows(start, start, start, error)
        by_slot = {slot: by_slot[slot] for slot in order}
    if block.wanted is None:
        alt_ids, alt_values = block.ids.reshape(-1), block.values.reshape(-1)
    else:
        alt_ids, alt_values = block.ids[block.wanted], block.values[block.wanted]
    return FrameDecode(by_slot, slots, positions, block.token_ids, block.chosen,
                       block.counts, block.offsets, alt_ids, alt_values)


def _row_error(slot, lane, block: _Block, positions, row: int, vocab_size: int):
    """The DecodeError naming a bad row's first failing check (position.py)."""
    words = (int(block.chosen_ids[row]), float(block.chosen[row]), block.ids[row].tolist(),
             block.values[row].tolist())
    return position_error(slot, int(positions[row]), int(block.token_ids[row]), words, lane,
                          int(block.counts[row]), vocab_size)


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


def _host_array(values: torch.Tensor | np.ndarray, dtype: type, name: str) -> np.ndarray:
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name}: expected a {np.dtype(dtype)} array, got {array.dtype}")
    return array
