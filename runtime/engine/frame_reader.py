"""Turns one host frame into per-request outcomes in generated-token order.

A record emits positions 0..EMITTED-1 in generated order (a speculative round's accepted
proposals, then its correction or bonus token); each becomes one GeneratedToken, with its
logprob entry unless the position is forced. A speculative record must agree with the plan:
OFFERED = the proposals the scheduler sent, ACCEPTED <= OFFERED, EMITTED <= ACCEPTED + 1,
and the first ACCEPTED emitted tokens are those proposals; anything else fails the request.
A request that scores its stop token (RequestSpec.stop_entry) emits it last: it becomes the
finish's entry, not a GeneratedToken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.runtime.engine.decoding.frame import decode_frame
from helios_logprobs.runtime.engine.decoding.lanes import DecodedEntry, LaneExpectation
from helios_logprobs.runtime.engine.executor import HostFrame
from helios_logprobs.runtime.engine.scheduler import Request
from helios_logprobs.runtime.outputs import Finished, GeneratedToken

FINISH_NAMES = {
    abi6.FinishReason.LENGTH: "length",
    abi6.FinishReason.EOS: "stop",
    abi6.FinishReason.STOP_TOKEN: "stop",
}


@dataclass
class SlotOutcome:
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish: Finished | None = None
    error: str | None = None
    offered: int = 0
    accepted: int = 0


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
            self.emitted += len(outcome.tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.offered if self.offered else 0.0


def round_error(record: list[int], proposals: tuple[int, ...], vocab_size: int) -> str | None:
    """Why a record disagrees with the round the plan sent, or None. A token outside the
    vocabulary fails its request here, so that it is never fed back to the model."""
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
) -> dict[int, SlotOutcome]:
    """``_read_frame``; then the host frame goes back to its pool (the results hold copies
    of its arrays), also when decoding fails."""
    try:
        return _read_frame(host, requests, vocab_size)
    finally:
        host.release()


def _read_frame(
    host: HostFrame, requests: list[Request], vocab_size: int
) -> dict[int, SlotOutcome]:
    """Outcomes keyed by request ordinal for the requests that sampled in this frame.

    Emitted tokens come from the records; logprob entries from the decoder, which checks each
    chosen id against the emitted token. A record of another submission (a stale frame) or a
    missing entry fails the request instead of delivering stale or incomplete tokens.
    """
    requesting = {r.slot: expectation(r) for r in requests if r.wants_logprobs}
    decoded = decode_frame(
        host.records, host.payload, requesting, vocab_size, submission=host.submission
    ) if requesting else {}
    outcomes: dict[int, SlotOutcome] = {}
    records = host.records
    for request in requests:
        record = records[request.slot].tolist()
        outcome = outcomes[request.ordinal] = SlotOutcome()
        if record[abi6.EPOCH] != request.epoch or record[abi6.SLOT] != request.slot:
            outcome.error = f"slot {request.slot}: record does not belong to this request"
            continue
        if record[abi6.SUBMISSION] != host.submission:
            outcome.error = (
                f"slot {request.slot}: stale record of submission {record[abi6.SUBMISSION]}, "
                f"expected {host.submission}"
            )
            continue
        error = round_error(record, request.proposals, vocab_size)
        if error is not None:
            outcome.error = f"slot {request.slot}: {error}"
            continue
        outcome.offered, outcome.accepted = record[abi6.OFFERED], record[abi6.ACCEPTED]
        emitted = record[abi6.HEADER : abi6.HEADER + record[abi6.EMITTED]]
        entries: tuple[DecodedEntry, ...] = ()
        if request.wants_logprobs:
            result = decoded[request.slot]
            entries = result.entries
            if result.error is not None:
                outcome.error = str(result.error)
        reason = abi6.FinishReason(record[abi6.FINISH_REASON])
        finishing = reason != abi6.FinishReason.NONE
        stopped = reason in (abi6.FinishReason.EOS, abi6.FinishReason.STOP_TOKEN)
        scored_stop = stopped and request.spec.stop_entry and bool(emitted)
        end: bool | None = finishing or (False if not request.spec.stop_token_ids else None)
        base, forced_mask = len(request.generated), record[abi6.FORCED_MASK]
        last = len(emitted) - 1 - int(scored_stop)  # (a scored stop token comes after it)
        held = len(entries)  # the decoder's entries, in emitted order without forced positions
        at = 0
        for position, token in enumerate(emitted):
            entry = entries[at] if at < held and entries[at].position == position else None
            if entry is not None:
                at += 1
            elif request.wants_logprobs and not (forced_mask >> position) & 1:
                outcome.error = outcome.error or f"missing logprob entry at position {position}"
                break
            outcome.tokens.append(GeneratedToken(
                base + position, token, None if entry is None else entry.logprob,
                () if entry is None else entry.alternatives, end if position == last else False,
            ))
        if outcome.error is not None or not finishing:
            continue
        stop_token, entry = None, None
        if scored_stop:  # its entry rides on the finish: it is no output token
            entry = outcome.tokens.pop()
            stop_token = entry.token_id
        elif stopped:
            stop_token = record[abi6.HEADER + len(emitted)]
        outcome.finish = Finished(FINISH_NAMES.get(reason, "stop"), stop_token, entry)
    return outcomes
