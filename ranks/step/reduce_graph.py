"""The reduce phase as one function of tensors: the gate, the reduction's launches and
exchanges (custom ops: kernels/cpu/ops.py, collectives/ops.py) and the payload write, which
``--compile`` hands to ``torch.compile(fullgraph=True)``.

Everything it reads is a static buffer: the step's row slots, epochs and positions and the
frame index (ranks/step/inputs.py StepBuffers), the reduction's logit rows, the completion
bundle. Every host value it depends on (K, the vocabulary and shard bounds, the group, T, the
bundle's capacity) is fixed at start-up, so one graph serves every submission: the frame is
a tensor (no specialisation on 0/1) and all ``max_rows`` rows go through the gate (rows past
the submission's last are -1 and fail it). The workspaces (request vectors, exchange words,
lse, packed rows) are local tensors of the function, not attributes: under compilation
Inductor plans their lifetimes. The launches are the reduction backend's custom ops: the
torch backend's (kernels/cpu/ops.py; one whole-vocabulary op on one rank), or the Triton
backend's three ``triton_op`` launch groups (kernels/triton/ops.py; at every world size, one
rank's exchanges being its own words), whose tile and candidate workspaces are local tensors
here too; only their geometry comes from the prepared kernels (compiled at start-up). A
compiled graph of the Triton ops needs CUDA: Inductor cannot run Triton kernels on CPU
tensors (the interpreter's CPU tests trace them with the eager backend). The payload write
rebuilds the active frame's [capacity x T] positions from a deterministic row map
(scatter_reduce amax of the gated rows' indices) and copies that one frame back, so the
inactive frame is never touched and rows that share no position never race.
"""

from __future__ import annotations

import torch

from helios_logprobs.collectives.ops import group_name, word_exchange
from helios_logprobs.kernels.cpu.ops import final_merge, shard_candidates, shard_stats
from helios_logprobs.kernels.cpu.ops import whole_reduction as whole_reduction_op
from helios_logprobs.kernels.layout import (
    EXCHANGE1_WORDS,
    EXCHANGE2_WORDS,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
    TILE_CANDIDATES,
)
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

GRAPH_BACKENDS = ("torch", "triton")


class ReductionGraph:
    def __init__(self, reduction, group: object, compile: bool) -> None:
        """``reduction``: the step's StepReduction (its logits, bundle and driver's bounds)."""
        driver = reduction.driver
        if driver.backend not in GRAPH_BACKENDS:
            raise ValueError(f"the reduction region takes the {' or '.join(GRAPH_BACKENDS)} "
                             f"backend's ops, got {driver.backend!r}")
        if not driver.normalize:
            raise ValueError("the reduction region reports logprobs (the *_logprobs modes)")
        self.reduction = reduction
        self.kernels = reduction.kernels
        """The Triton backend's prepared launches (their geometry and shard starts), or None."""
        if self.kernels is not None:
            import helios_logprobs.kernels.triton.ops  # noqa: F401  (registers helios::triton_*)
        outputs = reduction.outputs
        self.k, self.vocab_size = reduction.k, reduction.vocab_size
        self.vocab_start, self.local_valid = driver.vocab_start, driver.local_valid
        self.world, self.shard_starts = driver.world, list(driver.shard_starts)
        self.group_name = group_name(group)
        self.capacity = outputs.capacity
        self.tokens = outputs.completion_logprobs.shape[2]
        self.words = outputs.completion_logprobs.shape[3]
        self.supports_token_ids = outputs.supports_token_ids
        self.starts = None if self.kernels is None else \
            self.kernels.starts_tensor(driver.shard_starts)
        self.compiled = compile
        self.fn = torch.compile(self.region, fullgraph=True, dynamic=False) if compile \
            else self.region

    def __call__(self, row_tensors: torch.Tensor, frame_index: torch.Tensor) -> None:
        r, o = self.reduction, self.reduction.outputs
        self.fn(row_tensors, frame_index, r.logits, o.completion_records, o.logprob_requested,
                o.logprob_token_ids, o.logprob_token_id_counts, o.completion_logprobs)

    def region(self, row_tensors, frame_index, logits, records_all, flags, token_ids,
               token_counts, payload_all) -> None:
        row_slots, row_epochs, row_positions = row_tensors.unbind(0)
        rows = logits.shape[0]
        records = records_all.index_select(0, frame_index).squeeze(0)
        slots = row_slots.clamp(min=0)
        positions = row_positions.clamp(min=0, max=records.shape[1] - HEADER - 1)
        committed = records.index_select(0, slots)
        gate = (row_slots >= 0) & (row_positions >= 0)
        gate &= committed[:, SLOT] == row_slots
        gate &= committed[:, EPOCH] == row_epochs
        kind = committed[:, KIND]
        gate &= (kind == int(Kind.SAMPLE)) | (kind == int(Kind.SPECULATIVE))
        gate &= row_positions < committed[:, EMITTED]
        gate &= ((committed[:, FORCED_MASK] >> positions) & 1) == 0
        rows_arange = torch.arange(rows, device=logits.device)
        gate &= committed[:, FIRST_LOGIT_ROW] + row_positions == rows_arange
        gate &= flags.index_select(0, slots) != 0
        chosen = committed.gather(1, (HEADER + positions).unsqueeze(1)).squeeze(1)
        gate &= (chosen >= 0) & (chosen < self.vocab_size)
        requested = gate.to(torch.int32)
        if self.supports_token_ids:
            ids = token_ids.index_select(0, slots).to(torch.int32)
            counts = token_counts.index_select(0, slots).to(torch.int32)
        else:
            ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=logits.device)
            counts = torch.zeros(rows, dtype=torch.int32, device=logits.device)
        out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32, device=logits.device)
        self._launch(logits, chosen, ids, counts, requested, out)
        self._write(frame_index, payload_all, slots, positions, gate, out)

    def _launch(self, logits, chosen, ids, counts, requested, out) -> None:
        if self.kernels is not None:
            self._launch_triton(logits, chosen, ids, counts, requested, out)
            return
        rows, device, k = logits.shape[0], logits.device, self.k
        if self.world == 1:
            whole_reduction_op(logits, chosen, ids, counts, requested, k, self.vocab_size, out)
            return
        e1 = torch.empty(rows, EXCHANGE1_WORDS, dtype=torch.int32, device=device)
        e1_all = torch.empty(self.world * rows, EXCHANGE1_WORDS, dtype=torch.int32,
                             device=device)
        shard_stats(logits, chosen, ids, counts, requested, k, self.local_valid, e1)
        word_exchange(e1, e1_all, self.group_name)
        lse = torch.empty(rows, dtype=torch.float32, device=device)
        e2 = torch.empty(rows, EXCHANGE2_WORDS, dtype=torch.int32, device=device)
        shard_candidates(logits, chosen, ids, counts, requested, k,
                         e1_all.view(self.world, rows, EXCHANGE1_WORDS), self.vocab_start,
                         self.local_valid, lse, e2)
        e2_all = torch.empty(self.world * rows, EXCHANGE2_WORDS, dtype=torch.int32,
                             device=device)
        word_exchange(e2, e2_all, self.group_name)
        final_merge(e2_all.view(self.world, rows, EXCHANGE2_WORDS), lse, chosen, ids, counts,
                    requested, k, self.shard_starts, out)

    def _launch_triton(self, logits, chosen, ids, counts, requested, out) -> None:
        """The six launches as helios::triton_shard_stats, triton_shard_candidates and
        triton_final_merge, the workspaces local; one rank skips both exchanges."""
        p, rows, device = self.kernels, logits.shape[0], logits.device
        tile_max = torch.empty(rows, p.max_tiles, dtype=torch.float32, device=device)
        tile_mass = torch.empty(rows, p.max_tiles, dtype=torch.float32, device=device)
        cand = torch.empty(rows, p.max_tiles * TILE_CANDIDATES, dtype=torch.int64,
                           device=device)
        e1 = torch.empty(rows, EXCHANGE1_WORDS, dtype=torch.int32, device=device)
        ops = torch.ops.helios
        ops.triton_shard_stats(logits, requested, self.local_valid, p.block_size,
                               p.block_tiles, tile_max, tile_mass, e1)
        e1_all = self._gather(e1)
        lse = torch.empty(rows, dtype=torch.float32, device=device)
        e2 = torch.empty(rows, EXCHANGE2_WORDS, dtype=torch.int32, device=device)
        ops.triton_shard_candidates(logits, chosen, ids, counts, requested, e1_all,
                                    self.vocab_start, self.local_valid, p.block_size,
                                    p.merge_block, p.select, cand, lse, e2)
        ops.triton_final_merge(self._gather(e2), lse, chosen, ids, counts, requested,
                               self.starts, self.k, p.select, out)

    def _gather(self, words: torch.Tensor) -> torch.Tensor:
        """[world, rows, words]: every rank's send words in rank order."""
        if self.world == 1:
            return words.unsqueeze(0)
        rows, width = words.shape
        gathered = torch.empty(self.world * rows, width, dtype=words.dtype,
                               device=words.device)
        word_exchange(words, gathered, self.group_name)
        return gathered.view(self.world, rows, width)

    def _write(self, frame_index, payload_all, slots, positions, gate, out) -> None:
        rows, positions_per_frame = out.shape[0], self.capacity * self.tokens
        frames = payload_all.view(payload_all.shape[0], positions_per_frame, self.words)
        current = frames.index_select(0, frame_index).squeeze(0)
        target = torch.where(gate, slots * self.tokens + positions, 0)
        source = torch.where(gate, torch.arange(rows, device=out.device), -1)
        row_of = torch.full((positions_per_frame,), -1, dtype=torch.int64, device=out.device)
        row_of = row_of.scatter_reduce(0, target, source, "amax")
        packed = out.index_select(0, row_of.clamp(min=0))[:, : self.words]
        merged = torch.where((row_of >= 0).unsqueeze(1), packed, current)
        frames.index_copy_(0, frame_index, merged.unsqueeze(0))


def compile_counters() -> dict[str, int]:
    """Dynamo's account of this process: graphs compiled (each recompilation compiles one
    more) and graph breaks. With --compile both are fixed once the rank is built: a later
    change is a compile while serving. (Dynamo's frame counters stay 0 for fullgraph
    compiles, so the graphs stand for them.) Zeros where dynamo was never imported (nothing
    compiled; an eager server does not pay the import)."""
    import sys

    if "torch._dynamo.utils" not in sys.modules:
        return {"graphs": 0, "graph_breaks": 0}
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
