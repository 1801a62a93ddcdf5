"""The scored_prefill phase: a submission's scored chunk -> prompt_logprobs rows.

Built only with --prompt-logprobs. Each capacity C of the ladder (128, then x4 while below
the chunk limit, the chunk limit always the largest) owns its preallocated frame pair
``prompt_logprobs`` int32 [2, C, 43] and ``prompt_target_tokens`` int32 [C]; a chunk of n
rows uses the smallest C >= n and writes rows [0, n) of frame ``submission % 2`` only.

The chunk's final-normed hidden rows are projected through this rank's LM head shard at most
64 at a time into one reused [64, local_vocabulary] logit block (the only scoring logit
matrix), and each block is scored with two 64-word exchanges (kernels/scoring/driver.py).
Every rank runs the same blocks, so the exchanges line up.

Under --compile (``compile=True``) each block runs as one ``torch.compile(fullgraph=True)``
graph at the padded block shape [64 rows]: the projection, the three launches (custom ops,
kernels/scoring/ops.py) and the two exchanges (``helios::word_exchange``,
collectives/ops.py ``TracedExchange``). A block of fewer rows is padded with target -1 rows
(scored as nothing) and its rows copied out; the one graph is compiled at construction (a
warm-up block of padding), so nothing compiles while serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helios_logprobs.collectives.ops import TracedExchange, group_name
from helios_logprobs.kernels.layout import PROMPT_BLOCK_ROWS, PROMPT_ROW_WORDS
from helios_logprobs.kernels.scoring import ops as score_ops
from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring
from helios_logprobs.ranks.contract.declarations import (
    FRAMES,
    PROMPT_LOGPROBS,
    PROMPT_TARGET_TOKENS,
    BufferDecl,
)

LADDER_START = 128
LADDER_FACTOR = 4


def scored_capacities(chunk_limit: int) -> tuple[int, ...]:
    """128, x4 while below the chunk limit, the chunk limit always the largest:
    256 -> (128, 256); 2048 -> (128, 512, 2048); 64 -> (64,)."""
    if chunk_limit < 1:
        raise ValueError(f"chunk limit must be >= 1, got {chunk_limit}")
    ladder, c = [], LADDER_START
    while c < chunk_limit:
        ladder.append(c)
        c *= LADDER_FACTOR
    return (*ladder, chunk_limit)


@dataclass(frozen=True)
class ScoredFrames:
    """One ladder capacity's buffers."""

    prompt_logprobs: torch.Tensor
    """int32 [2, C, 43]: target id, FP32 logprob bits, rank, 20 (id, FP32 bits) pairs."""
    prompt_target_tokens: torch.Tensor
    """int32 [C]: the chunk's targets (-1 at the prompt end)."""

    @property
    def capacity(self) -> int:
        return self.prompt_target_tokens.shape[0]

    @classmethod
    def allocate(cls, capacity: int, device: torch.device) -> ScoredFrames:
        return cls(
            torch.full((FRAMES, capacity, PROMPT_ROW_WORDS), -1, dtype=torch.int32,
                       device=device),
            torch.full((capacity,), -1, dtype=torch.int32, device=device),
        )

    def declarations(self) -> tuple[BufferDecl, BufferDecl]:
        return (
            BufferDecl(PROMPT_LOGPROBS, "int32", tuple(self.prompt_logprobs.shape)),
            BufferDecl(PROMPT_TARGET_TOKENS, "int32", tuple(self.prompt_target_tokens.shape)),
        )


class PromptScorer:
    def __init__(self, model, group: object, chunk_limit: int, device: torch.device,
                 normalize: bool = True, compile: bool = False) -> None:
        """``normalize`` False (--logprobs-mode raw_logits or processed_logits): prompt rows
        report the raw logits, as vLLM's prompt positions do under those modes."""
        self.model = model
        self.ladder = tuple(
            ScoredFrames.allocate(c, device) for c in scored_capacities(chunk_limit)
        )
        self.block = torch.empty(PROMPT_BLOCK_ROWS, model.local_width, dtype=model.dtype,
                                 device=device)
        """The one [64, local_vocabulary] logit matrix, reused by every row block."""
        self.scoring = PreparedPromptScoring(
            group, model.local_width, model.vocab_start, model.local_valid, model.vocab_size,
            device, normalize,
        )
        cuda = torch.device(device).type == "cuda"
        self.targets_host = torch.full((self.ladder[-1].capacity,), -1, dtype=torch.int32,
                                       pin_memory=True) if cuda else None
        """CUDA: the pinned twin the targets are written to (numpy) and uploaded from."""
        self.uploaded = torch.cuda.Event() if cuda else None
        self.last: tuple[int, int] | None = None
        """(capacity, rows) of the last scored chunk, for the coordinator's copy."""
        self.graph: CompiledBlock | None = None
        """--compile: the padded block as one compiled graph (compiled here)."""
        if compile:
            self.graph = CompiledBlock(model, self.scoring, group, device)

    def frames_for(self, rows: int) -> ScoredFrames:
        for frames in self.ladder:
            if rows <= frames.capacity:
                return frames
        raise RuntimeError(f"a scored chunk of {rows} rows exceeds the chunk limit "
                           f"{self.ladder[-1].capacity}")

    def __call__(self, frame: int, hidden: torch.Tensor, targets: tuple[int, ...]) -> None:
        """Score one chunk: ``hidden`` [n, hidden] final-normed rows, ``targets`` [n]."""
        n = hidden.shape[0]
        frames = self.frames_for(n)
        target_tokens = frames.prompt_target_tokens
        if self.targets_host is None:
            target_tokens.numpy()[:n] = targets  # (numpy: no tensor storage per step)
        else:  # (the last upload has left the pinned twin; one non-blocking copy)
            self.uploaded.synchronize()
            self.targets_host.numpy()[:n] = targets
            target_tokens[:n].copy_(self.targets_host[:n], non_blocking=True)
            self.uploaded.record()
        rows = frames.prompt_logprobs[frame]
        for start in range(0, n, PROMPT_BLOCK_ROWS):
            stop = min(n, start + PROMPT_BLOCK_ROWS)
            if self.graph is not None:
                self.graph(hidden[start:stop], target_tokens[start:stop], rows[start:stop])
                continue
            logits = self.model.project(hidden[start:stop], out=self.block[: stop - start])
            self.scoring(logits, target_tokens[start:stop], rows[start:stop])
        self.last = (frames.capacity, n)


class CompiledBlock:
    """One scoring block [64 rows] compiled: projection, launches and exchanges over static
    buffers (the padded hidden rows, targets and scored rows); blocks of fewer rows are
    padded with target -1."""

    def __init__(self, model, scoring: PreparedPromptScoring, group: object,
                 device: torch.device, compile: bool = True) -> None:
        self.model, self.scoring = model, scoring
        self.exchange = TracedExchange(group_name(group), scoring.exchange1.world)
        rows, hidden = PROMPT_BLOCK_ROWS, model.weights.lm_head.shape[1]
        self.hidden = torch.zeros(rows, hidden, dtype=model.dtype, device=device)
        self.targets = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.out = torch.full((rows, PROMPT_ROW_WORDS), -1, dtype=torch.int32, device=device)
        self.fn = torch.compile(self.region, fullgraph=True, dynamic=False) if compile \
            else self.region
        self.run()  # (the compile, before serving)

    def arguments(self) -> tuple[torch.Tensor, ...]:
        s = self.scoring
        return (self.hidden, self.targets, self.out, s.exchange1.send, s.exchange2.send, s.lse,
                s.value)

    def run(self) -> None:
        with torch.no_grad():
            self.fn(*self.arguments())

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> None:
        """Score ``hidden`` [n <= 64, hidden] against ``targets`` [n] into ``out`` [n, 43]."""
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        self.targets[:n].copy_(targets)
        self.targets[n:].fill_(-1)
        self.run()
        out.copy_(self.out[:n])

    def region(self, hidden, targets, out, send1, send2, lse, value) -> None:
        s, exchange = self.scoring, self.exchange
        logits = self.model.project(hidden)
        score_ops.score_stats(logits, targets, s.vocab_start, s.local_valid, send1)
        e1_all = exchange.gather(send1)
        score_ops.score_candidates(logits, targets, e1_all, s.shard_starts, s.vocab_start,
                                   s.local_valid, s.normalize, lse, value, send2)
        score_ops.score_merge(exchange.gather(send2), targets, value, out)
