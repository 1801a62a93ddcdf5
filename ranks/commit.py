"""The commit writer: ABI6 records for one submission's active frame.

Token limits, the thinking budget, EOS and stop-token clipping happen here, so every reader
(the reduction, the executor, the decoder) only has to look at the record's emitted count
and forced mask. Records are built as Python rows and written into the frame in one copy per
submission.

One walk (``RecordBatch.emit``) commits both an ordinary sample (one row) and a speculative
round (rows 0..N of the slot's contiguous logit rows): at each position the target's token
is the forced token when the thinking budget forces one, else the sampled one; the position
is emitted unless it is a stop token (a scoring request's stop token is emitted, last:
RequestSpec.stop_entry), the walk ends at max_tokens, and it continues to the
next row only while the proposal for the next position equals this position's target token.
The first mismatch therefore emits the target's own token (the correction), and a round
whose every proposal is accepted emits the bonus token of its last row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.upload import LaneRequest
from helios_logprobs.ranks.plan import RequestSpec


def _last_index(tokens: Sequence[int], pattern: Sequence[int]) -> int:
    """Start of the last occurrence of ``pattern`` in ``tokens``; -1 when absent."""
    n = len(pattern)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == pattern[0] and list(tokens[i : i + n]) == list(pattern):
            return i
    return -1


def _ends_with(tokens: Sequence[int], pattern: Sequence[int]) -> bool:
    n = len(pattern)
    return len(tokens) >= n and list(tokens[len(tokens) - n :]) == list(pattern)


@dataclass
class ThinkingState:
    """The thinking budget of one request (vLLM's ThinkingTokenBudgetLogitsProcessor state).

    A span opens after the start string and closes after the end string. Once ``count``, the
    tokens generated inside the open span, reaches the budget, the end string's tokens are
    forced one per position (``forcing`` is the index of the next one), closing the span.
    """

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    inside: bool = False
    count: int = 0
    forcing: int = -1

    @classmethod
    def from_prompt(cls, spec: RequestSpec, prompt: Sequence[int]) -> ThinkingState:
        """A prompt that ends inside a span (its last start string after its last end
        string, as reasoning chat templates write it) counts the tokens after that start."""
        state = cls(spec.thinking_budget, spec.think_start, spec.think_end)
        opened = _last_index(prompt, spec.think_start)
        if opened > _last_index(prompt, spec.think_end):
            state.inside = True
            state.count = len(prompt) - opened - len(spec.think_start)
        return state

    def forced(self) -> int | None:
        """The token the next position must take, or None when it is sampled."""
        if self.forcing >= 0:
            return self.end[self.forcing]
        if self.inside and self.count >= self.budget:
            return self.end[0]
        return None

    def advance(self, output: Sequence[int], forced: bool) -> None:
        """After ``output[-1]`` was committed (``forced`` when it came from ``forced()``)."""
        if forced:
            self.forcing = max(self.forcing, 0) + 1
            if self.forcing == len(self.end):
                self.forcing, self.inside, self.count = -1, False, 0
        elif _ends_with(output, self.start):
            self.inside, self.count = True, 0
        elif _ends_with(output, self.end):
            self.inside, self.count = False, 0
        elif self.inside:
            self.count += 1


@dataclass
class SlotState:
    """What every rank remembers about the request occupying a slot."""

    epoch: int
    spec: RequestSpec
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    length: int = 0
    """Tokens whose K/V are in the cache."""
    thinking: ThinkingState | None = None
    """The thinking budget's state, from the request's first sampled position on."""
    lane: LaneRequest | None = None
    """What the request's logprob lane uploads every step (built on its first sampled step;
    the uploader validates a lane object once)."""

    def thinking_state(self) -> ThinkingState | None:
        if self.thinking is None and self.spec.thinking_budget is not None:
            self.thinking = ThinkingState.from_prompt(self.spec, self.prompt)
        return self.thinking


class RecordBatch:
    """The records of one submission, written to the frame by ``flush``."""

    def __init__(self, width: int, submission: int) -> None:
        self.width = width
        self.submission = submission
        self.slots: list[int] = []
        self.rows: list[list[int]] = []

    def _row(self, slot: int, state: SlotState, kind: abi6.Kind) -> list[int]:
        row = [0] * self.width
        row[abi6.SLOT] = slot
        row[abi6.EPOCH] = state.epoch
        row[abi6.REQUEST_ORDINAL] = state.spec.ordinal
        row[abi6.KIND] = int(kind)
        row[abi6.SEQUENCE_LENGTH] = state.length
        row[abi6.SUBMISSION] = self.submission
        self.slots.append(slot)
        self.rows.append(row)
        return row

    def admission(self, slot: int, state: SlotState, scored: bool = False) -> None:
        """A prefill chunk that samples nothing: a record, no emitted token (kind scored
        prefill for a scored chunk, whose scores are in the prompt_logprobs frame)."""
        self._row(slot, state, abi6.Kind.SCORED_PREFILL if scored else abi6.Kind.ADMISSION)

    def sample(self, slot: int, state: SlotState, token: int, logit_row: int) -> bool:
        """Commit one ordinarily sampled token; returns whether it was emitted (stop tokens
        are not). OFFERED and ACCEPTED stay zero: they count speculative proposals only."""
        return self.emit(slot, state, (token,), (), logit_row) == 1

    def emit(
        self,
        slot: int,
        state: SlotState,
        sampled: Sequence[int],
        proposals: Sequence[int],
        first_row: int,
    ) -> int:
        """Commit a slot's sampled rows (the walk in the module docstring); returns the
        emitted count.

        ``sampled[i]`` is the target's sampled token of the slot's row i (len(proposals) + 1
        rows), ``first_row`` the logit row of row 0 in the logits the reduction reads: the
        emitted position i's row is ``first_row + i``. A round rolls the slot's cached
        length back to the accepted prefix: its fed tokens are (last, p1..pN), of which the
        last token and the accepted p1..pa are the sequence, so the rejected proposals' K/V
        lie past the length and are overwritten before any later query can reach them.
        """
        kind = abi6.Kind.SPECULATIVE if proposals else abi6.Kind.SAMPLE
        row = self._row(slot, state, kind)
        row[abi6.FIRST_LOGIT_ROW] = first_row
        row[abi6.OFFERED] = len(proposals)
        spec, output = state.spec, state.output
        thinking = state.thinking_state()
        emitted = accepted = forced_mask = 0
        for i, target in enumerate(sampled):
            forced = thinking.forced() if thinking is not None else None
            token = target if forced is None else forced
            row[abi6.HEADER + i] = token
            if token in spec.stop_token_ids:
                # The terminating token stays in its token slot for the coordinator to
                # read. It is not emitted (no logprob, no text) unless the request scores it
                # (stop_entry): then it is the last emitted position, never part of the output.
                row[abi6.FINISH_REASON] = int(abi6.FinishReason.STOP_TOKEN)
                if spec.stop_entry:
                    emitted += 1
                break
            output.append(token)
            if thinking is not None:
                thinking.advance(output, forced is not None)
            if forced is not None:
                forced_mask |= 1 << i
            emitted += 1
            if len(output) >= spec.max_tokens:
                row[abi6.FINISH_REASON] = int(abi6.FinishReason.LENGTH)
                break
            if i >= len(proposals) or proposals[i] != token:
                break
            accepted += 1
        row[abi6.EMITTED] = emitted
        row[abi6.ACCEPTED] = accepted
        row[abi6.FORCED_MASK] = forced_mask
        state.length -= len(proposals) - accepted
        row[abi6.SEQUENCE_LENGTH] = state.length
        return emitted

    def flush(self, records: torch.Tensor) -> None:
        """Clear the frame's records and write this submission's rows."""
        records.zero_()
        if self.slots and records.device.type == "cpu":
            records.numpy()[self.slots] = self.rows  # (numpy: no tensor storage per step)
        elif self.slots:
            index = torch.tensor(self.slots, dtype=torch.int64, device=records.device)
            records[index] = torch.tensor(self.rows, dtype=records.dtype, device=records.device)
