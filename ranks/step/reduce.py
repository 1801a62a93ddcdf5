"""Phase five of a step: the gated logprob reduction, bound to the completion bundle.

Built only for a core with logprob outputs. Everything it uses is prepared at construction,
before serving: the six-launch driver and its two exchanges for ``capacity`` rows, with the
Triton backend the prepared kernel object and its shard starts, and one warm-up call with
every flag zero that runs (and compiles) each launch and both exchanges with the serving
arguments. Every rank constructs it at the same point, since the driver and the warm-up are
collective.

The reduction reads the active completion frame after its token writer finishes (for a
speculative round, after the commit's acceptance walk, so it consumes the same emitted count
and physical ownership as the commit). Logit row r of ``logits`` is sampling row r of the
submission; its slot, epoch and emitted position i come from the step's inputs. Row r is
reduced only when the committed record of that slot (device tensor ops, no host lists) has
the row's slot and epoch, kind SAMPLE or SPECULATIVE, i < EMITTED, position i not forced,
FIRST_LOGIT_ROW + i = r, the slot's uploaded flag set, and the record's token slot i a
vocabulary id (a sampler fault fails its request on the host, not the step); that token is
the row's chosen token, and its packed words go to payload position i of the slot. Ordinary
sampling emits position zero. Rows of duplicate, inactive or stale slots, rejected or exhausted
positions (past the emitted count: after a mismatch, max_tokens, EOS or a stop id) and
unoffered positions fail the gate and do no reduction; a slot's payload positions past its
emitted prefix are neither read nor written. Every rank computes the same records and flags,
so every rank gates the same rows. At TP1 on CPU the gate, the compiled reduction and the
write are one C call (gate.c's step_reduce), which hands rows it cannot vouch for back to the
driver's own path.

``--logprobs-mode`` (vLLM's four values, ranks/step/config.py): the ``processed_*`` modes read
the sampler's scratch, the rows after every processor, temperature and the top-k/top-p/min-p
mask (filtered lanes at -inf), instead of the raw logits, so the reduction's own exchange 1
carries the kept set's maximum and mass and a processed logprob is x - lse over the kept
tokens; the ``*_logits`` modes subtract no normalization (kernels/sharded.py). A call with
``entropy`` also writes each gated row's entropy of the reported distribution into
``entropy_frames[frame, slot, position]`` (FP32; one more word of exchange 1).
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sharded import PreparedShardedReduction
from helios_logprobs.ranks.contract.abi6 import (
    EMITTED,
    EPOCH,
    FIRST_LOGIT_ROW,
    FORCED_MASK,
    HEADER,
    KIND,
    SLOT,
    Kind,
)
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.step.gate_native import NativeStepGate, native_gate


class StepReduction:
    def __init__(
        self,
        model,
        group: object,
        outputs: CompletionOutputs,
        backend: str,
        device: torch.device,
        rows: int | None = None,
        source: torch.Tensor | None = None,
        normalize: bool = True,
    ) -> None:
        """``rows``: the most sampling rows of one submission (capacity x (1 + N) with
        speculative rounds; the capacity without). ``source``: the buffer [rows,
        local_width] the reduction reads (the sampler's FP32 scratch in the processed modes;
        default its own buffer of the model's dtype, which the forward projects into).
        ``normalize``: False for the ``*_logits`` modes."""
        cap = rows or outputs.capacity
        self.outputs = outputs
        self.k = outputs.k
        self.vocab_size = model.vocab_size
        self.reads_raw = source is None
        """Whether the forward projects its logits into ``logits`` (the raw modes)."""
        if source is not None and tuple(source.shape) != (cap, model.local_width):
            raise ValueError(f"source: expected {(cap, model.local_width)}, got "
                             f"{tuple(source.shape)}")
        self.logits = torch.zeros(cap, model.local_width, dtype=model.dtype, device=device) \
            if source is None else source
        """The logits the reduction reads: row r holds sampling row r (FIRST_LOGIT_ROW)."""
        self.entropy = torch.full((cap,), float("nan"), dtype=torch.float32, device=device)
        self.entropy_frames = torch.full(outputs.completion_logprobs.shape[:3], float("nan"),
                                         dtype=torch.float32, device=device)
        """FP32 [2, capacity, T]: the entropy of each gated position of a frame, written by
        calls with ``entropy`` (other positions keep their value)."""
        self.rows = torch.arange(cap, dtype=torch.int64, device=device)
        self.kinds = torch.tensor([int(Kind.SAMPLE), int(Kind.SPECULATIVE)], device=device)
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
            repeated=True,
            normalize=normalize,
        )
        self.kernels = self._prepare_kernels() if backend == "triton" else None
        # Host tensors: gate and write in C (gate.c; tensor ops cost microseconds each on CPU,
        # and the gate is a dozen of them). Without a compiler, and on CUDA, the tensor ops.
        lib = native_gate() if torch.device(device).type == "cpu" else None
        self.native = None if lib is None else NativeStepGate(
            lib, outputs, self.requested, self.chosen, self.ids, self.counts, self.out,
            model.vocab_size)
        self.driver(self.logits, self.request, self.out)  # warm-up: every flag is zero
        self.call = None if self.native is None else self.driver.native_call(
            self.logits, self.request, self.out)
        """At TP1 on CPU: the driver's compiled C call, which the native gate runs between
        the gate and the write (one C call per step)."""

    def _prepare_kernels(self):
        """The Triton launches' prepared object for every row of the bundle, with the shard
        starts the final launch reads already on the device."""
        from helios_logprobs.kernels.triton.sharded import prepared_sharded

        logits = self.logits
        kernels = prepared_sharded(logits.shape[0], logits.shape[1], logits.dtype, logits.device)
        kernels.starts_tensor(self.driver.shard_starts)
        return kernels

    def __call__(
        self,
        frame: int,
        logits: torch.Tensor,
        row_slots: list[int],
        row_epochs: list[int],
        row_positions: list[int] | None = None,
        row_tensors: torch.Tensor | None = None,
        entropy: bool = False,
    ) -> None:
        """Reduce the gated rows of ``logits`` [rows, local_width] into their emitted
        positions (``row_positions``; 0 for every row of a slot when omitted) in ``frame``'s
        packed output. The row lists hold one entry per buffer row (-1 past the last row);
        ``row_tensors``: the same three lists as int64 [3, buffer rows] on the device (the
        step's static inputs), which the tensor gate reads instead of building them.
        ``entropy``: also the gated rows' entropy into ``entropy_frames``."""
        rows = logits.shape[0]
        if row_positions is None:
            row_positions = [0 if slot >= 0 else -1 for slot in row_slots]
        if logits.data_ptr() != self.logits.data_ptr():
            self.logits[:rows].copy_(logits)
        if self.call is not None and not entropy:
            if self.native.step(frame, row_slots, row_epochs, row_positions, rows, self.call,
                                torch.get_num_threads()):
                return  # gate, reduction and write in one C call
            # The C call gated the rows and left some to Python: the driver's own path.
            slots, positions = self.native.row_tensors()
        else:  # (with entropy at TP1 on CPU too: the gate, then the driver's path)
            if row_tensors is None:
                row_tensors = torch.tensor((row_slots, row_epochs, row_positions),
                                           dtype=torch.int64, device=self.rows.device)
            slots, epochs, positions = row_tensors
            self.gate(frame, slots, epochs, positions)
        if entropy:
            self.driver(self.logits, self.request, self.out, entropy_out=self.entropy)
        else:
            self.driver(self.logits, self.request, self.out)
        self.write(frame, slots[:rows], positions[:rows])
        if entropy:
            self.write_entropy(frame, slots[:rows], positions[:rows])

    def gate(
        self,
        frame: int,
        row_slots: torch.Tensor,
        row_epochs: torch.Tensor,
        row_positions: torch.Tensor,
    ) -> None:
        """The per-row request (flag, chosen token, selected IDs) from the frame's committed
        records [capacity, 16+T] and the uploaded flag vector."""
        if self.native is not None:
            self.native.gate(frame, row_slots, row_epochs, row_positions)
            return
        records = self.outputs.completion_records[frame]
        slots = row_slots.clamp(min=0)
        positions = row_positions.clamp(min=0, max=records.shape[1] - HEADER - 1)
        committed = records.index_select(0, slots)
        gate = (row_slots >= 0) & (row_positions >= 0)
        gate &= committed[:, SLOT] == row_slots
        gate &= committed[:, EPOCH] == row_epochs
        gate &= torch.isin(committed[:, KIND], self.kinds)
        gate &= row_positions < committed[:, EMITTED]
        gate &= ((committed[:, FORCED_MASK] >> positions) & 1) == 0
        gate &= committed[:, FIRST_LOGIT_ROW] + row_positions == self.rows
        gate &= self.outputs.logprob_requested.index_select(0, slots) != 0
        chosen = committed.gather(1, (HEADER + positions).unsqueeze(1)).squeeze(1)
        gate &= (chosen >= 0) & (chosen < self.vocab_size)
        self.requested.copy_(gate)
        self.chosen.copy_(chosen)
        if self.outputs.supports_token_ids:
            torch.index_select(self.outputs.logprob_token_ids, 0, slots, out=self.ids)
            torch.index_select(self.outputs.logprob_token_id_counts, 0, slots, out=self.counts)

    def write(self, frame: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Emitted position i of each gated row's slot gets the row's packed words (the
        payload's 2+2K or 258). Ungated rows write back the words already at their (slot,
        position) unchanged, so the write is one fixed-shape index copy over the frame's
        [capacity x T] positions; the inactive frame is never touched."""
        if self.native is not None:
            self.native.write(frame, slots, positions)
            return
        payload = self.outputs.completion_logprobs[frame]
        tokens, words = payload.shape[1], payload.shape[2]
        target = payload.view(-1, words)
        index = slots * tokens + positions.clamp(min=0)
        gated = self.requested[: slots.shape[0], None] != 0
        merged = torch.where(gated, self.out[: slots.shape[0], :words], target[index])
        target.index_copy_(0, index, merged)

    def write_entropy(self, frame: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Each gated row's entropy into its (slot, emitted position) of ``frame``; ungated
        rows write back what is there (the payload write's rule)."""
        target = self.entropy_frames[frame]
        flat = target.view(-1)
        index = slots.clamp(min=0) * target.shape[1] + positions.clamp(min=0)
        gated = self.requested[: slots.shape[0]] != 0
        flat.index_copy_(0, index, torch.where(gated, self.entropy[: slots.shape[0]],
                                               flat[index]))
