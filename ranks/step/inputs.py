"""Phase one of a step: the plan -> graph inputs, slot states and admission records.

Sampling rows (the rows of the forward's logits and of the logits the reduction reads) follow
plan order: an ordinary sampling item has one row (its last token's), a speculative round
(SlotWork.proposals = p1..pN) has 1 + N contiguous rows, row i being the logits after
(last, p1..pi), i.e. emitted position i of the slot's record (packed targets). ``row_slots``
/ ``row_epochs`` / ``row_positions`` give each row's physical slot, epoch and emitted
position as lists of the step's ``max_rows`` (-1 past the last row): they are what the
reduction's gate compares with the committed records (it makes them vectors on its device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helios_logprobs.ranks.commit import RecordBatch, SlotState
from helios_logprobs.ranks.contract.upload import LaneRequest
from helios_logprobs.ranks.plan import SlotWork, StepPlan
from helios_logprobs.ranks.step.config import StepConfig


@dataclass(frozen=True)
class SampleRow:
    """One sampling work item: the slot, its first logit row, and its proposals (a round's
    rows are first_row .. first_row + len(proposals))."""

    slot: int
    state: SlotState
    first_row: int = 0
    proposals: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        """Logit rows of this item."""
        return 1 + len(self.proposals)


@dataclass(frozen=True)
class StepInputs:
    plan: StepPlan
    token_ids: torch.Tensor
    """int64 [tokens]: every planned token, in plan order."""
    positions: torch.Tensor
    """int64 [tokens]: each token's position in its slot's sequence."""
    slots: torch.Tensor
    """int64 [tokens]: each token's physical slot."""
    logit_index: torch.Tensor
    """int64 [rows]: the token whose logits sampling row r takes."""
    rows: tuple[SampleRow, ...]
    """The sampling work items, in plan order (row order)."""
    row_slots: list[int]
    """[max_rows]: sampling row r's slot; -1 past the last row."""
    row_epochs: list[int]
    """[max_rows]: sampling row r's slot epoch; -1 past the last row."""
    row_positions: list[int]
    """[max_rows]: sampling row r's emitted position in its slot's record (0 for an ordinary
    sample, i for row i of a round); -1 past the last row."""
    records: RecordBatch
    """This submission's records so far: the admission records of chunks that do not sample."""
    lanes: dict[int, LaneRequest]
    """The logprob lanes of this submission (slot -> request), for the upload."""
    scored_index: torch.Tensor
    """int64 [n]: the tokens of the submission's scored chunk (empty when none)."""
    scored_targets: tuple[int, ...] = ()
    """The scored chunk's targets (SlotWork.targets)."""

    @property
    def frame(self) -> int:
        return self.plan.frame


def prepare_inputs(
    plan: StepPlan,
    slots: dict[int, SlotState],
    config: StepConfig,
    record_width: int,
    device: torch.device,
) -> StepInputs:
    """Admit new requests into ``slots``, advance each slot's cached length and build the
    step's inputs (records ``record_width`` = 16+T words wide). Raises RuntimeError for a plan
    that disagrees with this rank's slots."""
    records = RecordBatch(record_width, plan.submission)
    ids: list[int] = []
    positions: list[int] = []
    token_slots: list[int] = []
    logit_index: list[int] = []
    rows: list[SampleRow] = []
    lanes: dict[int, LaneRequest] = {}
    scored_index: list[int] = []
    for work in plan.work:
        state = _slot_state(work, slots, config)
        if not state.output:
            state.prompt.extend(work.tokens)
        ids.extend(work.tokens)
        positions.extend(range(work.start, work.start + len(work.tokens)))
        token_slots.extend([work.slot] * len(work.tokens))
        state.length += len(work.tokens)
        if work.targets:
            if not config.prompt_logprobs:
                raise RuntimeError(f"slot {work.slot}: a scored chunk on a core without scoring")
            scored_index.extend(range(len(ids) - len(work.tokens), len(ids)))
        if not work.samples:
            records.admission(work.slot, state, scored=bool(work.targets))
            continue
        if work.proposals and not config.speculative_tokens:
            raise RuntimeError(f"slot {work.slot}: a speculative round on a step built "
                               f"without speculative_tokens")
        if len(work.proposals) > config.speculative_tokens:
            raise RuntimeError(f"slot {work.slot}: {len(work.proposals)} proposals, the step "
                               f"verifies at most {config.speculative_tokens}")
        first_row = len(logit_index)
        logit_index.extend(range(len(ids) - 1 - len(work.proposals), len(ids)))
        rows.append(SampleRow(work.slot, state, first_row, work.proposals))
        if state.spec.wants_logprobs:
            if not config.logprobs:
                raise RuntimeError(
                    f"slot {work.slot} requests logprobs; the core declares no logprob outputs"
                )
            if state.lane is None:
                state.lane = LaneRequest(natural_alternatives=config.max_logprobs,
                                         token_ids=state.spec.logprob_token_ids or None)
            lanes[work.slot] = state.lane
    row_slots = [-1] * config.max_rows
    row_epochs = [-1] * config.max_rows
    row_positions = [-1] * config.max_rows
    for row in rows:
        for i in range(row.count):
            r = row.first_row + i
            row_slots[r], row_epochs[r], row_positions[r] = row.slot, row.state.epoch, i

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return StepInputs(
        plan=plan,
        token_ids=as_long(ids),
        positions=as_long(positions),
        slots=as_long(token_slots),
        logit_index=as_long(logit_index),
        rows=tuple(rows),
        row_slots=row_slots,
        row_epochs=row_epochs,
        row_positions=row_positions,
        records=records,
        lanes=lanes,
        scored_index=as_long(scored_index),
        scored_targets=plan.scored.targets if plan.scored else (),
    )


def _slot_state(work: SlotWork, slots: dict[int, SlotState], config: StepConfig) -> SlotState:
    """The slot's state for this work item: a new one on a request's first chunk."""
    if work.request is not None:
        if not 0 <= work.slot < config.capacity:
            raise ValueError(f"slot {work.slot} outside capacity {config.capacity}")
        slots[work.slot] = SlotState(epoch=work.epoch, spec=work.request)
    state = slots.get(work.slot)
    if state is None or state.epoch != work.epoch:
        raise RuntimeError(f"slot {work.slot}: no request with epoch {work.epoch}")
    if work.start != state.length:
        raise RuntimeError(
            f"slot {work.slot}: plan starts at {work.start}, cache holds {state.length}"
        )
    if work.start + len(work.tokens) > config.max_seq_len:
        raise RuntimeError(f"slot {work.slot}: sequence exceeds max_seq_len")
    return state
