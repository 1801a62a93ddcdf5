"""The scored_prefill phase: a submission's scored chunk -> prompt_logprobs rows.

Built only with --prompt-logprobs. Each capacity C of the ladder (128, then x4 while below
the chunk limit, the chunk limit always the largest) owns its preallocated frame pair
``prompt_logprobs`` int32 [2, C, 43] and ``prompt_target_tokens`` int32 [C]; a chunk of n
rows uses the smallest C >= n and writes rows [0, n) of frame ``submission % 2`` only.

The chunk's final-normed hidden rows are projected through this rank's LM head shard at most
64 at a time into one reused [64, local_vocabulary] logit block (the only scoring logit
matrix), and each block is scored with two 64-word exchanges (kernels/scoring/driver.py).
Every rank runs the same blocks, so the exchanges line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helios_logprobs.kernels.layout import PROMPT_BLOCK_ROWS, PROMPT_ROW_WORDS
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
                 normalize: bool = True) -> None:
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
            logits = self.model.project(hidden[start:stop], out=self.block[: stop - start])
            self.scoring(logits, target_tokens[start:stop], rows[start:stop])
        self.last = (frames.capacity, n)
