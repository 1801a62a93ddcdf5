"""Phase one of a step: the plan -> graph inputs, slot states and admission records.

Sampling rows (the rows of the forward's logits and of the logits the reduction reads) follow
plan order: an ordinary sampling item has one row (its last token's), a speculative round
(SlotWork.proposals = p1..pN) has 1 + N contiguous rows, row i being the logits after
(last, p1..pi), i.e. emitted position i of the slot's record (packed targets). ``row_slots``
/ ``row_epochs`` / ``row_positions`` give each row's physical slot, epoch and emitted
position as lists of the step's ``max_rows`` (-1 past the last row): they are what the
reduction's gate compares with the committed records; ``row_tensors`` holds the same three
as int64 [3, max_rows] on the step's device).

Every tensor of the inputs is a view of ``StepBuffers``: one int64 vector per rank, sized at
start-up from the step's token budget and rows, that prepare fills (through a numpy view of
the host buffer, then on CUDA one fixed-size non-blocking copy from pinned memory). The
later phases take views of it, so a captured graph reads the same addresses every step and
prepare allocates no tensor storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.ranks.commit import RecordBatch, SlotState
from helios_logprobs.ranks.contract.upload import LaneRequest
from helios_logprobs.ranks.plan import SlotWork, StepPlan
from helios_logprobs.ranks.sampler.plan import SamplePlan
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
    row_index: torch.Tensor | None = None
    """int64 [rows + n]: logit_index then scored_index, contiguous (the forward's rows)."""
    row_tensors: torch.Tensor | None = None
    """int64 [3, max_rows]: row_slots, row_epochs, row_positions on the step's device."""
    frame_index: torch.Tensor | None = None
    """int64 [1]: the submission's frame (submission % 2) on the step's device."""
    host: tuple[list[int], list[int], list[int], list[int]] | None = None
    """(token ids, positions, slots, forward rows) as host lists, checked in prepare, so the
    forward reads no tensor back to decide anything."""
    sampling: SamplePlan | None = None
    """The sampler's plan of the rows (RankStep.prepare makes it; None without rows)."""

    @property
    def frame(self) -> int:
        return self.plan.frame


class StepBuffers:
    """The step's static int64 inputs, laid out in one vector: token ids, positions, slots
    [token_budget each], forward rows [max_rows + chunk_limit], the rows' slots, epochs
    and positions [max_rows each] and the frame index [1]."""

    def __init__(self, config: StepConfig, device: torch.device) -> None:
        tokens, rows = config.token_budget, config.max_rows
        self.tokens, self.rows, self.scored = tokens, rows, config.chunk_limit
        sizes = (tokens, tokens, tokens, rows + config.chunk_limit, 3 * rows, 1)
        total = sum(sizes)
        self.device = torch.device(device)
        self.values = torch.zeros(total, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=cuda) if cuda \
            else self.values
        self.array = self.host.numpy()
        self.uploaded = torch.cuda.Event() if cuda else None
        bounds = np.cumsum((0, *sizes)).tolist()
        spans = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        self._spans = spans
        self.token_ids, self.positions, self.slots, self.row_index = (
            self.values[span] for span in spans[:4])
        self.row_tensors = self.values[spans[4]].view(3, rows)
        self.frame_index = self.values[spans[5]]
        self.row_tensors.fill_(-1)

    def write(self, ids: list[int], positions: list[int], slots: list[int],
              forward_rows: list[int], row_values: list[int], frame: int) -> None:
        """Fill the host buffer (numpy; no tensor storage) and, on CUDA, upload it whole."""
        if len(ids) > self.tokens:
            raise RuntimeError(f"{len(ids)} tokens exceed the step's budget {self.tokens}")
        if len(forward_rows) > self.rows + self.scored:
            raise RuntimeError(f"{len(forward_rows)} forward rows exceed "
                               f"{self.rows + self.scored}")
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the last upload has left the pinned buffer
        for span, values in zip(self._spans, (ids, positions, slots, forward_rows),
                                strict=False):
            self.array[span.start : span.start + len(values)] = values
        self.array[self._spans[4]] = row_values
        self.array[self._spans[5]] = frame
        if self.host is not self.values:
            self.values.copy_(self.host, non_blocking=True)
            self.uploaded.record()


def prepare_inputs(
    plan: StepPlan,
    slots: dict[int, SlotState],
    config: StepConfig,
    record_width: int,
    device: torch.device,
    buffers: StepBuffers | None = None,
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

    if buffers is None:
        buffers = StepBuffers(config, device)
    forward_rows = logit_index + scored_index
    buffers.write(ids, positions, token_slots, forward_rows,
                  row_slots + row_epochs + row_positions, plan.frame)
    n, r = len(ids), len(logit_index)
    return StepInputs(
        plan=plan,
        token_ids=buffers.token_ids[:n],
        positions=buffers.positions[:n],
        slots=buffers.slots[:n],
        logit_index=buffers.row_index[:r],
        rows=tuple(rows),
        row_slots=row_slots,
        row_epochs=row_epochs,
        row_positions=row_positions,
        records=records,
        lanes=lanes,
        scored_index=buffers.row_index[r : len(forward_rows)],
        scored_targets=plan.scored.targets if plan.scored else (),
        row_index=buffers.row_index[: len(forward_rows)],
        row_tensors=buffers.row_tensors,
        frame_index=buffers.frame_index,
        host=(ids, positions, token_slots, forward_rows),
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
