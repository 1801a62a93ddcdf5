"""One submission on one rank: forward, sharded sampling, commit, gated logprob reduction.

Every rank runs exactly this for every plan, so the collectives inside the model, the sampler
and the reduction line up. Only the coordinator reads the frames afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.layout import EXPORT_K, PAYLOAD_WORDS
from kernels.rows import RowRequest
from kernels.sharded import PreparedShardedReduction
from ranks.commit import RecordBatch, SlotState
from ranks.completion import CompletionOutputs
from ranks.plan import RequestSpec, StepPlan
from ranks.sampler import ShardedSampler
from ranks.upload import LaneRequest, LogprobUploader, UploadResult


@dataclass(frozen=True)
class StepConfig:
    capacity: int
    max_seq_len: int
    token_capacity: int = 8
    reduction_backend: str = "torch"

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")


class RankStep:
    def __init__(self, model, group, config: StepConfig, device: torch.device | str = "cpu"):
        self.model = model
        self.group = group
        self.config = config
        self.device = torch.device(device)
        self.slots: dict[int, SlotState] = {}
        self.upload = UploadResult(requesting_slots=(), copy_width=0)
        """The last submission's upload: requesting slots and the copy width W."""
        cap = config.capacity
        model.allocate_cache(cap, config.max_seq_len)
        self.outputs = CompletionOutputs.allocate(cap, config.token_capacity, device=self.device)
        self.uploader = LogprobUploader(
            self.outputs, vocab_size=model.vocab_size, k=EXPORT_K, supports_token_ids=True
        )
        self.sampler = ShardedSampler(
            group,
            vocab_start=model.vocab_start,
            local_valid=model.local_valid,
            local_width=model.local_width,
            vocab_size=model.vocab_size,
            max_rows=cap,
            device=self.device,
        )
        self.logit_rows = torch.zeros(cap, model.local_width, dtype=model.dtype, device=self.device)
        self.chosen = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.reduce_requested = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self.reduce_out = torch.full(
            (cap, PAYLOAD_WORDS), -1, dtype=torch.int32, device=self.device
        )
        self.reduction = PreparedShardedReduction(
            group,
            rows=cap,
            width=model.local_width,
            vocab_start=model.vocab_start,
            local_valid=model.local_valid,
            vocab_size=model.vocab_size,
            backend=config.reduction_backend,
            device=self.device,
        )

    def _admit(self, slot: int, epoch: int, spec: RequestSpec) -> SlotState:
        if not 0 <= slot < self.config.capacity:
            raise ValueError(f"slot {slot} outside capacity {self.config.capacity}")
        state = SlotState(epoch=epoch, spec=spec)
        self.slots[slot] = state
        return state

    def run(self, plan: StepPlan) -> None:
        frame = plan.frame
        records = self.outputs.completion_records[frame]
        batch = RecordBatch(records.shape[1], plan.submission)
        ids, positions, slot_ids, logit_index, sampling_work = [], [], [], [], []
        lanes: dict[int, LaneRequest] = {}
        for work in plan.work:
            state = self._admit(work.slot, work.epoch, work.request) if work.request else None
            state = state or self.slots.get(work.slot)
            if state is None or state.epoch != work.epoch:
                raise RuntimeError(f"slot {work.slot}: no request with epoch {work.epoch}")
            if work.start != state.length:
                raise RuntimeError(
                    f"slot {work.slot}: plan starts at {work.start}, cache holds {state.length}"
                )
            if work.start + len(work.tokens) > self.config.max_seq_len:
                raise RuntimeError(f"slot {work.slot}: sequence exceeds max_seq_len")
            if not state.output:
                state.prompt.extend(work.tokens)
            ids.extend(work.tokens)
            positions.extend(range(work.start, work.start + len(work.tokens)))
            slot_ids.extend([work.slot] * len(work.tokens))
            state.length += len(work.tokens)
            if work.samples:
                logit_index.append(len(ids) - 1)
                sampling_work.append((work.slot, state))
                if state.spec.logprobs:
                    lanes[work.slot] = LaneRequest(
                        logprobs=EXPORT_K, token_ids=state.spec.logprob_token_ids or None
                    )
            else:
                batch.admission(work.slot, state)
        self.upload = self.uploader.upload(lanes)
        if not ids:
            batch.flush(records)
            return
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
        logits = self.model.forward(
            as_long(ids), as_long(positions), as_long(slot_ids), as_long(logit_index)
        )
        if not sampling_work:
            batch.flush(records)
            return
        states = [state for _, state in sampling_work]
        tokens = self.sampler.sample(
            logits,
            [replace(s.spec.sampling, position=len(s.output)) for s in states],
            [s.prompt for s in states],
            [s.output for s in states],
        )
        reduce_rows, reduce_slots = [], []
        for row, ((slot, state), token) in enumerate(zip(sampling_work, tokens.tolist(),
                                                         strict=True)):
            if batch.sample(slot, state, token, slot) and slot in lanes:
                reduce_rows.append(row)
                reduce_slots.append(slot)
        batch.flush(records)
        self._reduce(frame, logits, tokens, reduce_rows, reduce_slots)

    def _reduce(self, frame, logits, tokens, rows: list[int], slots: list[int]) -> None:
        """Gated reduction over slot-indexed logit rows; only emitting, flagged lanes are read."""
        if not slots:
            # Every rank derives the lanes from the same plan and tokens, so all skip together.
            return
        self.reduce_requested.zero_()
        to_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        to_slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.logit_rows[to_slots] = logits[to_rows]
        self.chosen[to_slots] = tokens[to_rows]
        self.reduce_requested[to_slots] = 1
        self.reduce_requested.mul_(self.outputs.logprob_requested)
        request = RowRequest(
            self.chosen,
            self.outputs.logprob_token_ids,
            self.outputs.logprob_token_id_counts,
            self.reduce_requested,
            EXPORT_K,
        )
        self.reduction(self.logit_rows, request, self.reduce_out)
        self.outputs.completion_logprobs[frame, to_slots, 0] = self.reduce_out[to_slots]
