"""Phase five of a step: the gated logprob reduction, bound to the completion bundle.

Built only for a core with logprob outputs. Everything it uses is prepared at construction,
before serving: the six-launch driver and its two exchanges for ``capacity`` rows, with the
Triton backend the prepared kernel object and its shard starts, and one warm-up call with
every flag zero that runs (and compiles) each launch and both exchanges with the serving
arguments. Every rank constructs it at the same point, since the driver and the warm-up are
collective.

The reduction reads the active completion frame after its token writer finishes. Logit row r
of ``logits`` is sampling row r of the submission; its slot and epoch come from the step's
inputs. Row r is reduced only when the committed record of that slot (device tensor ops, no
host lists) has the row's slot and epoch, kind SAMPLE, at least one emitted token, position
zero not forced, FIRST_LOGIT_ROW r, and the slot's uploaded flag set. Ordinary sampling emits
position zero, whose chosen token is the record's first token slot. Every rank computes the
same records and flags, so every rank gates the same rows.
"""

from __future__ import annotations

import torch

from kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from kernels.rows import RowRequest
from kernels.sharded import PreparedShardedReduction
from ranks.abi6 import EMITTED, EPOCH, FIRST_LOGIT_ROW, FORCED_MASK, HEADER, KIND, SLOT, Kind
from ranks.completion import CompletionOutputs


class StepReduction:
    def __init__(
        self,
        model,
        group: object,
        outputs: CompletionOutputs,
        backend: str,
        device: torch.device,
    ) -> None:
        cap = outputs.capacity
        self.outputs = outputs
        self.k = outputs.k
        self.logits = torch.zeros(cap, model.local_width, dtype=model.dtype, device=device)
        """The logits the reduction reads: row r holds sampling row r (FIRST_LOGIT_ROW)."""
        self.rows = torch.arange(cap, dtype=torch.int64, device=device)
        self.chosen = torch.zeros(cap, dtype=torch.int64, device=device)
        self.requested = torch.zeros(cap, dtype=torch.int32, device=device)
        self.ids = torch.full((cap, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(cap, dtype=torch.int32, device=device)
        """Per-row selected IDs and counts (constant -1 / 0 without the ID inputs)."""
        self.out = torch.full((cap, PAYLOAD_WORDS), -1, dtype=torch.int32, device=device)
        self.request = RowRequest(self.chosen, self.ids, self.counts, self.requested, self.k)
        self.driver = PreparedShardedReduction(
            group,
            rows=cap,
            width=model.local_width,
            vocab_start=model.vocab_start,
            local_valid=model.local_valid,
            vocab_size=model.vocab_size,
            backend=backend,
            device=device,
        )
        self.kernels = self._prepare_kernels() if backend == "triton" else None
        self.driver(self.logits, self.request, self.out)  # warm-up: every flag is zero

    def _prepare_kernels(self):
        """The Triton launches' prepared object for every row of the bundle, with the shard
        starts the final launch reads already on the device."""
        from kernels.triton.sharded import prepared_sharded

        logits = self.logits
        kernels = prepared_sharded(logits.shape[0], logits.shape[1], logits.dtype, logits.device)
        kernels.starts_tensor(self.driver.shard_starts)
        return kernels

    def __call__(
        self,
        frame: int,
        logits: torch.Tensor,
        row_slots: torch.Tensor,
        row_epochs: torch.Tensor,
    ) -> None:
        """Reduce the gated rows of ``logits`` [rows, local_width] into position zero of their
        slots in ``frame``'s packed output."""
        rows = logits.shape[0]
        self.logits[:rows].copy_(logits)
        self.gate(self.outputs.completion_records[frame], row_slots, row_epochs)
        self.driver(self.logits, self.request, self.out)
        self.write(frame, row_slots[:rows])

    def gate(
        self, records: torch.Tensor, row_slots: torch.Tensor, row_epochs: torch.Tensor
    ) -> None:
        """The per-row request (flag, chosen token, selected IDs) from the committed records
        [capacity, 16+T] and the uploaded flag vector."""
        slots = row_slots.clamp(min=0)
        committed = records.index_select(0, slots)
        gate = row_slots >= 0
        gate &= committed[:, SLOT] == row_slots
        gate &= committed[:, EPOCH] == row_epochs
        gate &= committed[:, KIND] == int(Kind.SAMPLE)
        gate &= committed[:, EMITTED] >= 1
        gate &= (committed[:, FORCED_MASK] & 1) == 0
        gate &= committed[:, FIRST_LOGIT_ROW] == self.rows
        gate &= self.outputs.logprob_requested.index_select(0, slots) != 0
        self.requested.copy_(gate)
        self.chosen.copy_(committed[:, HEADER])
        if self.outputs.supports_token_ids:
            torch.index_select(self.outputs.logprob_token_ids, 0, slots, out=self.ids)
            torch.index_select(self.outputs.logprob_token_id_counts, 0, slots, out=self.counts)

    def write(self, frame: int, slots: torch.Tensor) -> None:
        """Position zero of each gated row's slot gets the row's packed words (the payload's
        2+2K or 258). Ungated rows write back their own words unchanged, so the write is one
        fixed-shape index copy; the inactive frame is never touched."""
        target = self.outputs.completion_logprobs[frame, :, 0]
        words = target.shape[-1]
        gated = self.requested[: slots.shape[0], None] != 0
        merged = torch.where(gated, self.out[: slots.shape[0], :words], target[slots])
        target.index_copy_(0, slots, merged)
