"""RankStep: one submission on one rank, as five named phases.

    prepare  the plan -> token/position/slot tensors, slot states, admission records, and
             the upload of the logprob flags, counts and ID prefixes
    forward  the sharded model -> logits [sampling rows, local vocabulary]
    sample   the sharded sampler -> one token per sampling row, identical on every rank
             (a speculative round's rows are its verification: ranks/speculative.py), then
             ``readback``: the one point where the step reads device values on the host
    commit   ABI6 records into the active frame (the token writer): acceptance, limits,
             thinking-budget forcing, stop tokens
    reduce   the gated logprob reduction, which reads the committed records
    score    the submission's scored_prefill chunk -> prompt_logprobs rows (ranks/step/scoring)

Scored prefill and graph capture each replace or wrap one phase. Prepare makes every host
decision: it writes the step's static input buffers (``StepBuffers``, sized at start-up),
hands the forward its host lists and plans the sampler's rows (``ShardedSampler.plan``: row
paths, index, parameter and processor tensors); forward, sample and reduce read only tensors
(the reduction's gate takes the row slots, epochs and positions from the same buffers; the
capture-safe sampler, CUDA's, reads nothing on the host), and commit works on the read-back
tokens (tests/unit/ranks/test_capture_safe_step.py and test_capture_sample.py check it under
a guard).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from helios_logprobs.kernels.layout import EXPORT_K
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.contract.core import capabilities
from helios_logprobs.ranks.contract.upload import LogprobUploader, UploadResult
from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
from helios_logprobs.ranks.speculative import sampler_rows, split_rows
from helios_logprobs.ranks.step.config import StepConfig
from helios_logprobs.ranks.step.cuda_graphs import decode_graphs
from helios_logprobs.ranks.step.device_memory import device_memory
from helios_logprobs.ranks.step.forward_graph import ForwardGraph, ForwardVariant
from helios_logprobs.ranks.step.inputs import StepBuffers, StepInputs, prepare_inputs
from helios_logprobs.ranks.step.reduce import StepReduction
from helios_logprobs.ranks.step.reduce_graph import ReductionGraph, compile_counters
from helios_logprobs.ranks.step.sample_graph import SampleGraph
from helios_logprobs.ranks.step.scoring import PromptScorer

NO_UPLOAD = UploadResult(requesting_slots=(), copy_width=0)


def completion_outputs(config: StepConfig, device: torch.device) -> CompletionOutputs:
    """The complete bundle (K=20, and the records-only core), or the natural-only layout
    for 1 <= K < 20."""
    if 0 < config.max_logprobs < EXPORT_K:
        return CompletionOutputs.allocate_natural(
            config.capacity, config.max_logprobs, config.token_capacity, device
        )
    return CompletionOutputs.allocate(config.capacity, config.token_capacity, device)


class RankStep:
    def __init__(self, model, group, config: StepConfig, device: torch.device | str = "cpu"):
        self.model = model
        self.group = group
        self.config = config
        self.device = torch.device(device)
        self.slots = {}
        """Physical slot -> SlotState of the request occupying it."""
        self.upload = NO_UPLOAD
        """The last submission's upload: requesting slots and the copy width W."""
        compiles_forward = config.compile and not getattr(model, "batch_invariant", False)
        model.allocate_cache(config.capacity, config.max_seq_len,
                             spare_slots=1 if compiles_forward else 0)
        self.buffers = StepBuffers(config, self.device)
        """The step's static inputs, written by prepare."""
        self.outputs = completion_outputs(config, self.device)
        self.scorer: PromptScorer | None = None
        if config.prompt_logprobs:
            self.scorer = PromptScorer(model, group, config.chunk_limit, self.device,
                                       normalize=config.normalized, compile=compiles_forward)
        scored = tuple(f.declarations() for f in self.scorer.ladder) if self.scorer else ()
        self.capabilities = capabilities(self.outputs, config.logprobs, scored)
        """The validated core: K and whether it takes selected IDs (malformed fails here)."""
        self.sampler = ShardedSampler(
            group,
            vocab_start=model.vocab_start,
            local_valid=model.local_valid,
            local_width=model.local_width,
            vocab_size=model.vocab_size,
            max_rows=config.max_rows,
            device=self.device,
            # processed modes: every row through the scratch, which the reduction then reads;
            # --compile: the capture-safe sampler (fixed shapes, no host read; docs/performance)
            capture_safe=True if config.processed or config.compile else None,
        )
        self.sample_graph = SampleGraph(self.sampler, group) if config.compile else None
        """--compile: the sample phase as one compiled graph per row bucket, every bucket
        compiled here (ranks/step/sample_graph.py)."""
        self.uploader: LogprobUploader | None = None
        self.reduction: StepReduction | None = None
        if self.capabilities.allow_logprobs:
            caps = self.capabilities
            self.uploader = LogprobUploader(
                self.outputs, model.vocab_size, caps.k, caps.supports_token_ids
            )
            self.reduction = StepReduction(
                model, group, self.outputs, config.reduction_backend, self.device,
                rows=config.max_rows, normalize=config.normalized,
                source=self.sampler.scratch if config.processed else None,
            )
        self.graph: ReductionGraph | None = None
        """--compile: the reduce phase as one compiled graph, compiled here (a warm-up call
        with every row ungated) before the server reports ready."""
        if config.compile and self.reduction is not None:
            self.graph = ReductionGraph(self.reduction, group, compile=True)
            self.graph(self.buffers.row_tensors, self.buffers.frame_index)
        self.forward_graph: ForwardGraph | None = None
        """--compile: the forward as one compiled graph over padded token buckets
        (ranks/step/forward_graph.py), every bucket run here on the spare slot only."""
        if compiles_forward:
            self.forward_graph = ForwardGraph(model, config.capacity, config.max_seq_len,
                                              config.max_rows, config.token_budget,
                                              self.device)
        self.variant: ForwardVariant | None = None
        """The compiled variant prepare chose for this submission (None: eager forward)."""
        self.cuda_graphs = decode_graphs(self)
        """CUDA with config.cuda_graphs: the captured decode variants (None: all eager)."""
        self.compiled_at_start = compile_counters()
        """Dynamo's counters once the step is built (its compiles done): serve_stats'
        recompilations are the graphs compiled since."""

    def serve_stats(self) -> dict[str, int]:
        """What /metrics shows of this rank's process (helios:compile_*, helios:device_memory_*):
        dynamo's graphs and graph breaks, the graphs compiled after start-up
        (``compile_recompilations``: 0 while serving means nothing compiled mid-serving), and
        on CUDA the allocator's allocated and reserved bytes and its graph pools' bytes (0
        until a graph is captured; ranks/step/device_memory.py), absent on the CPU."""
        now = compile_counters()
        stats = {"compile_graphs": now["graphs"], "compile_graph_breaks": now["graph_breaks"],
                 "compile_recompilations": now["graphs"] - self.compiled_at_start["graphs"]}
        stats.update(device_memory(self.device))
        return stats

    def run(self, plan: StepPlan) -> None:
        inputs = self.prepare(plan)
        logits, scored_hidden = self.forward(inputs)
        tokens = self.readback(self.sample(inputs, logits))
        self.commit(inputs, tokens)
        self.reduce(inputs, logits)
        self.score(inputs, scored_hidden)

    def prepare(self, plan: StepPlan) -> StepInputs:
        width = self.outputs.completion_records.shape[-1]
        inputs = prepare_inputs(plan, self.slots, self.config, width, self.device,
                                self.buffers)
        if inputs.rows:  # (the sampler's host decisions: ranks/sampler/plan.py)
            masks = {w.slot: w.grammar_masks for w in plan.work if w.grammar_masks}
            rows = sampler_rows(inputs.rows, masks)
            if self.sample_graph is not None:  # (padded to its bucket: a fixed shape)
                rows = self.sample_graph.pad(*rows)
            inputs = replace(inputs, sampling=self.sampler.plan(*rows))
            if self.sample_graph is not None:
                self.sample_graph.prepare(inputs.sampling)
        if self.forward_graph is not None:
            self.variant = self.forward_graph.select(inputs.host)
        # A submission without sampling rows runs no graph with logprob outputs: no transfers.
        sampling = self.uploader is not None and bool(inputs.rows)
        self.upload = self.uploader.upload(inputs.lanes) if sampling else NO_UPLOAD
        return inputs

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits of the sampling rows, final-normed hidden rows of the scored chunk)."""
        if not inputs.token_ids.numel():
            return None, None
        sampling = inputs.logit_index.numel()
        graphs = self.cuda_graphs
        captured = None if graphs is None else graphs.forward(inputs, self.variant)
        if captured is not None:  # (a decode submission: its bucket's graph replayed)
            return captured, None
        if self.variant is not None:
            self.model.check_batch(inputs.token_ids, inputs.positions, inputs.slots,
                                   inputs.row_index, inputs.host)
            self.forward_graph.load(self.variant, inputs.token_ids, inputs.positions,
                                    inputs.slots)
            hidden = self.variant.run().index_select(0, inputs.row_index)
        else:
            hidden = self.model.forward_hidden(inputs.token_ids, inputs.positions,
                                               inputs.slots, inputs.row_index, inputs.host)
        # The logits go straight into the buffer the reduction reads (no copy of them).
        reads_raw = self.reduction is not None and self.reduction.reads_raw
        out = self.reduction.logits[:sampling] if reads_raw else None
        logits = self.model.project(hidden[:sampling], out=out)
        return logits, (hidden[sampling:] if inputs.scored_index.numel() else None)

    def sample(self, inputs: StepInputs, logits: torch.Tensor | None) -> torch.Tensor | None:
        """One token per sampling row (int64, on the step's device); None without rows."""
        if not inputs.rows:
            return None
        if self.sample_graph is not None:
            return self.sample_graph.run(logits, logits.shape[0])
        return self.sampler.run(logits, inputs.sampling)

    @staticmethod
    def readback(tokens: torch.Tensor | None) -> list[int]:
        """The sampled tokens on the host, for the commit writer (the step's one read)."""
        return [] if tokens is None else tokens.tolist()

    def commit(self, inputs: StepInputs, tokens: list[int]) -> None:
        for row, sampled in zip(inputs.rows, split_rows(inputs.rows, tokens), strict=True):
            inputs.records.emit(row.slot, row.state, sampled, row.proposals, row.first_row)
        inputs.records.flush(self.outputs.completion_records[inputs.frame])

    def reduce(self, inputs: StepInputs, logits: torch.Tensor | None) -> None:
        # Whether any lane requests is the same on every rank (the same plan and upload).
        if self.reduction is None or not self.upload.requesting_slots or not inputs.rows:
            return
        if self.cuda_graphs is not None and self.cuda_graphs.reduce(inputs):
            return  # (a decode submission: the frame's captured reduce phase replayed)
        entropy = inputs.plan.entropy
        if self.graph is not None and not entropy:  # (the compiled region has no entropy)
            self.graph(inputs.row_tensors, inputs.frame_index)
            return
        source = logits if self.reduction.reads_raw else self.reduction.logits[: len(logits)]
        self.reduction(inputs.frame, source, inputs.row_slots, inputs.row_epochs,
                       inputs.row_positions, inputs.row_tensors, entropy=entropy)

    def score(self, inputs: StepInputs, hidden: torch.Tensor | None) -> None:
        if self.scorer is None:
            return
        self.scorer.last = None
        if hidden is not None:
            self.scorer(inputs.frame, hidden, inputs.scored_targets)
