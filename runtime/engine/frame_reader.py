"""Turns one host frame into per-request outcomes and the frame's tokens as arrays.

A record emits positions 0..EMITTED-1 in generated order (a speculative round's accepted
proposals, then its correction or bonus token); each becomes one row of FrameTokens, with its
logprob entry unless the position is forced. A speculative record must agree with the plan:
OFFERED = the proposals the scheduler sent, ACCEPTED <= OFFERED, EMITTED <= ACCEPTED + 1,
and the first ACCEPTED emitted tokens are those proposals; anything else fails the request.
A request that scores its stop token (RequestSpec.stop_entry) emits it last: it becomes the
finish's entry, not a delivered row. No per-token Python object is built here: the rows go
to the consumers as arrays (the engine core's StepPacker; an in-process Sink rebuilds them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.runtime.engine.decoding.frame import FrameDecode, decode_arrays
from helios_logprobs.runtime.engine.decoding.lanes import LaneExpectation
from helios_logprobs.runtime.engine.executor import HostFrame
from helios_logprobs.runtime.engine.frame_tokens import LAST_CODES, FrameTokens
from helios_logprobs.runtime.engine.scheduler import Request
from helios_logprobs.runtime.outputs import Finished

_SAMPLE = int(abi6.Kind.SAMPLE)
_STOPPED = frozenset((int(abi6.FinishReason.EOS), int(abi6.FinishReason.STOP_TOKEN)))
_REASONS = frozenset(int(reason) for reason in abi6.FinishReason)
FINISH_NAMES = {
    abi6.FinishReason.LENGTH: "length",
    abi6.FinishReason.EOS: "stop",
    abi6.FinishReason.STOP_TOKEN: "stop",
}


@dataclass
class SlotOutcome:
    """A request's rows ``start:stop`` of the frame's tokens are delivered (those before an
    error, or every emitted one but a scored stop token), then its finish or error."""

    start: int = 0
    stop: int = 0
    finish: Finished | None = None
    error: str | None = None
    offered: int = 0
    accepted: int = 0

    @property
    def emitted(self) -> int:
        return self.stop - self.start


@dataclass
class SpeculationCounters:
    """Speculative rounds the coordinator read: proposals offered and accepted, tokens
    emitted by rounds (acceptance rate = accepted / offered)."""

    rounds: int = 0
    offered: int = 0
    accepted: int = 0
    emitted: int = 0

    def add(self, proposals: tuple[int, ...], outcome: SlotOutcome) -> None:
        if proposals:
            self.rounds += 1
            self.offered += outcome.offered
            self.accepted += outcome.accepted
            self.emitted += outcome.emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.offered if self.offered else 0.0


def round_error(record: list[int], proposals: tuple[int, ...], vocab_size: int) -> str | None:
    """Why a record disagrees with the round the plan sent, or None. A token outside the
    vocabulary fails its request here, so that it is never fed back to the model."""
    if (not proposals and record[abi6.KIND] == _SAMPLE and record[abi6.EMITTED] == 1
            and not record[abi6.OFFERED] and not record[abi6.ACCEPTED]
            and 0 <= record[abi6.HEADER] < vocab_size):  # (an ordinary decode, in one test)
        return None
    kind = abi6.Kind.SPECULATIVE if proposals else abi6.Kind.SAMPLE
    offered, accepted = record[abi6.OFFERED], record[abi6.ACCEPTED]
    emitted = record[abi6.HEADER : abi6.HEADER + record[abi6.EMITTED]]
    if record[abi6.KIND] != kind or offered != len(proposals):
        return (f"record kind {record[abi6.KIND]} offers {offered}, the plan proposed "
                f"{len(proposals)}")
    if not 0 <= accepted <= offered or len(emitted) > accepted + 1:
        return f"record accepts {accepted} of {offered} and emits {len(emitted)}"
    if emitted[:accepted] != list(proposals[:accepted]):
        return "accepted tokens differ from the proposals"
    for token in emitted:
        if not 0 <= token < vocab_size:
            return f"sampled token id {token} outside the vocabulary [0, {vocab_size})"
    return None


def expectation(request: Request) -> LaneExpectation:
    lane = request.lane
    if lane is None or lane.epoch != request.epoch:
        ids = request.spec.logprob_token_ids
        lane = request.lane = LaneExpectation(
            epoch=request.epoch,
            ordinal=request.ordinal,
            logprobs=None if ids else (request.params.logprobs or 0),
            token_ids=ids or None,
        )
    return lane


def read_frame(
    host: HostFrame, requests: list[Request], vocab_size: int
) -> tuple[FrameTokens, dict[int, SlotOutcome]]:
    """``_read_frame``; then the host frame goes back to its pool (the results hold copies
    of its arrays), also when decoding fails."""
    try:
        return _read_frame(host, requests, vocab_size)
    finally:
        host.release()


def _read_frame(
    host: HostFrame, requests: list[Request], vocab_size: int
) -> tuple[FrameTokens, dict[int, SlotOutcome]]:
    """The frame's tokens, and outcomes keyed by request ordinal for the requests that sampled
    in this frame.

    Emitted tokens come from the records; logprob entries from the decoder, which checks each
    chosen id against the emitted token. A record of another submission (a stale frame) or a
    failing entry fails the request instead of delivering stale or incomplete tokens.
    """
    requests = sorted(requests, key=lambda r: r.slot)  # (the decoder's rows are in slot order)
    records = host.records
    headers = records[[r.slot for r in requests]].tolist() if requests else []
    requesting = {r.slot: expectation(r) for r in requests if r.wants_logprobs}
    decoded = decode_arrays(
        host.records, host.payload, requesting, vocab_size, submission=host.submission,
        headers=headers if len(requesting) == len(requests) else
        [h for r, h in zip(requests, headers, strict=True) if r.wants_logprobs],
    ) if requesting else None
    outcomes: dict[int, SlotOutcome] = {}
    rows = _Rows()
    entries: list[tuple[SlotOutcome, str, int]] = []  # scored stop tokens: (outcome, reason, row)
    for request, record in zip(requests, headers, strict=True):
        outcome = outcomes[request.ordinal] = SlotOutcome(rows.total, rows.total)
        outcome.error = record_error(request, record, host.submission, vocab_size)
        if outcome.error is not None:
            continue
        outcome.offered, outcome.accepted = record[abi6.OFFERED], record[abi6.ACCEPTED]
        emitted = record[abi6.EMITTED]
        wants = request.wants_logprobs
        start = rows.add(request.slot, emitted, len(request.generated), wants)
        delivered = emitted
        if wants:
            lane = decoded.lanes[request.slot]
            if lane.error is not None:
                outcome.error = str(lane.error)
                delivered = (int(decoded.positions[lane.good]) if lane.good < lane.stop
                             else _first_unforced(record[abi6.FORCED_MASK], emitted))
        reason = record[abi6.FINISH_REASON]
        if reason not in _REASONS:
            abi6.FinishReason(reason)  # (raises: a record no step writes)
        finishing = reason != 0
        stopped = reason in _STOPPED
        scored_stop = stopped and emitted > 0 and request.spec.stop_entry
        last = emitted - 1 - scored_stop  # (a scored stop token comes after it)
        if last >= 0 and (finishing or request.spec.stop_token_ids):
            rows.mark_last(start + last, True if finishing else None)
        if outcome.error is not None:
            outcome.stop = start + delivered
            continue
        outcome.stop = start + emitted - scored_stop
        if not finishing:
            continue
        name = FINISH_NAMES.get(reason, "stop")
        if scored_stop:  # its entry rides on the finish: it is no output token
            entries.append((outcome, name, start + emitted - 1))
        else:
            stop_token = record[abi6.HEADER + emitted] if stopped else None
            outcome.finish = Finished(name, stop_token)
    frame = rows.frame(records, decoded)
    if host.entropy is not None:  # (a plan with an entropy request: StepPlan.entropy)
        wanted = {r.slot for r in requests if r.spec.wants_entropy}
        frame = replace(frame, entropy=rows.entropy(host.entropy, frame.values, wanted))
    for outcome, name, row in entries:
        entry = frame.tokens(row, row + 1)[0]
        outcome.finish = Finished(name, entry.token_id, entry)
    return frame, outcomes


def record_error(request: Request, record: list[int], submission: int,
                 vocab_size: int) -> str | None:
    """Why the request's record cannot be read in this frame, or None."""
    if record[abi6.EPOCH] != request.epoch or record[abi6.SLOT] != request.slot:
        return f"slot {request.slot}: record does not belong to this request"
    if record[abi6.SUBMISSION] != submission:
        return (f"slot {request.slot}: stale record of submission {record[abi6.SUBMISSION]}, "
                f"expected {submission}")
    error = round_error(record, request.proposals, vocab_size)
    return None if error is None else f"slot {request.slot}: {error}"


def _first_unforced(forced_mask: int, emitted: int) -> int:
    return next((p for p in range(emitted) if not (forced_mask >> p) & 1), emitted)


class _Rows:
    """The frame's rows, request by request, built into FrameTokens at the end."""

    def __init__(self) -> None:
        self.total = 0
        self.slots: list[int] = []
        self.counts: list[int] = []
        self.bases: list[int] = []
        self.last_rows: list[int] = []
        self.last_codes: list[int] = []
        self.all_requesting = True
        self.single = True

    def add(self, slot: int, emitted: int, base: int, requesting: bool) -> int:
        start = self.total
        self.slots.append(slot)
        self.counts.append(emitted)
        self.bases.append(base)
        self.total += emitted
        self.all_requesting = self.all_requesting and requesting
        self.single = self.single and emitted == 1
        return start

    def mark_last(self, row: int, end: bool | None) -> None:
        """Row ``row`` is the request's last of the frame: True, it finishes; None, a stop
        token sampled next could finish it (every other row is False: more follow)."""
        self.last_rows.append(row)
        self.last_codes.append(LAST_CODES[end])

    def entropy(self, table: np.ndarray, values: np.ndarray, wanted: set[int]) -> np.ndarray:
        """Each row's entropy from ``table`` [capacity, T] at its (slot, position): NaN for
        rows of requests that did not ask for it and for rows without a logprob (a forced or
        failed position, which the reduction did not write)."""
        counts = np.array(self.counts, dtype=np.int64)
        slots = np.repeat(np.array(self.slots, dtype=np.int64), counts)
        positions = np.arange(self.total) - np.repeat(np.cumsum(counts) - counts, counts)
        out = table[slots, positions].astype(np.float32)
        keep = np.isin(slots, list(wanted)) & ~np.isnan(values)
        out[~keep] = np.nan
        return out

    def frame(self, records: np.ndarray, decoded: FrameDecode | None) -> FrameTokens:
        n = self.total
        if self.single:  # (one token each: an ordinary decode step)
            positions = np.zeros(n, dtype=np.int64)
            bases = np.array(self.bases, dtype=np.int64)
            starts = np.arange(n)
        else:
            counts = np.array(self.counts, dtype=np.int64)
            starts = np.cumsum(counts) - counts
            positions = np.arange(n) - np.repeat(starts, counts)
            bases = np.repeat(np.array(self.bases, dtype=np.int64), counts)
        indexes = (bases + positions).astype(np.int32)
        last = np.zeros(n, dtype=np.int8)
        last[self.last_rows] = self.last_codes
        if (decoded is not None and self.all_requesting and len(decoded.positions) == n
                and len(decoded.lanes) == len(self.slots)):
            # Every row is a decoded entry, in the same order (requests and lanes by slot).
            return FrameTokens(indexes, decoded.token_ids, decoded.values, last,
                               decoded.alt_counts, decoded.alt_offsets, decoded.alt_ids,
                               decoded.alt_values)
        slots = np.repeat(np.array(self.slots, dtype=np.int64), self.counts)
        token_ids = records[slots, abi6.HEADER + positions].astype(np.int32)
        values = np.full(n, np.nan, dtype=np.float32)
        alt_counts = np.zeros(n, dtype=np.int32)
        offsets = np.zeros(n + 1, dtype=np.int64)
        if decoded is None or not len(decoded.positions):
            empty = np.zeros(0, dtype=np.int32)
            return FrameTokens(indexes, token_ids, values, last, alt_counts, offsets, empty,
                               empty.view(np.float32))
        first_row = np.full(records.shape[0], -1, dtype=np.int64)
        first_row[self.slots] = starts
        at = first_row[decoded.slots]
        picked = np.flatnonzero(at >= 0)  # (not a lane whose request failed its checks here)
        frame_rows = at[picked] + decoded.positions[picked]
        values[frame_rows] = decoded.values[picked]
        alt_counts[frame_rows] = decoded.alt_counts[picked]
        np.cumsum(alt_counts, out=offsets[1:])
        decoded_row = np.full(n, -1, dtype=np.int64)
        decoded_row[frame_rows] = picked
        taken = decoded_row[decoded_row >= 0]  # (decoded rows in frame order)
        alt_rows = _ranges(decoded.alt_offsets[taken], decoded.alt_counts[taken])
        return FrameTokens(indexes, token_ids, values, last, alt_counts, offsets,
                           decoded.alt_ids[alt_rows], decoded.alt_values[alt_rows])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[0]..starts[0]+lengths[0]-1, starts[1].., as one int64 array."""
    lengths = lengths.astype(np.int64)
    return np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths),
                                                     lengths)
