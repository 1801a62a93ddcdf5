"""The driver of sharded prompt scoring: one row block of at most 64 rows per call,
stats -> gather -> candidates -> gather -> merge (layouts in kernels/scoring/steps.py; the
three launches are custom ops, kernels/scoring/ops.py, so a compiled block has no graph
break)."""

from __future__ import annotations

import torch

from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.kernels.layout import PROMPT_BLOCK_ROWS, PROMPT_EXCHANGE_WORDS
from helios_logprobs.kernels.scoring import ops
from helios_logprobs.kernels.scoring.steps import check_block
from helios_logprobs.kernels.sharded import agreed_shard_starts


class PreparedPromptScoring:
    """Built once per rank (collective: every rank of the group constructs it at the same
    point); each call scores one block of rows with exactly two 64-word exchanges."""

    def __init__(
        self,
        group: object,
        width: int,
        vocab_start: int,
        local_valid: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        normalize: bool = True,
    ) -> None:
        """``normalize`` False: report logits, not logprobs (kernels/scoring/steps.py
        target_values)."""
        if not 0 <= local_valid <= width:
            raise ValueError(f"local_valid {local_valid} outside [0, {width}]")
        self.width = width
        self.vocab_start = vocab_start
        self.local_valid = local_valid
        self.normalize = normalize
        rows = PROMPT_BLOCK_ROWS
        self.shard_starts = agreed_shard_starts(group, vocab_start, local_valid, vocab_size,
                                                rows)
        self.exchange1 = WordExchange(group, rows, PROMPT_EXCHANGE_WORDS, device)
        self.exchange2 = WordExchange(group, rows, PROMPT_EXCHANGE_WORDS, device)
        self.lse = torch.zeros(rows, dtype=torch.float32, device=device)
        self.value = torch.zeros(rows, dtype=torch.float32, device=device)
        """The block's lse and the targets' reported values (written by the candidates op)."""

    @property
    def bytes_sent(self) -> int:
        return self.exchange1.bytes_sent + self.exchange2.bytes_sent

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        n = check_block(logits, targets, out)
        if logits.shape[1] != self.width:
            raise ValueError(f"logits: expected width {self.width}, got {logits.shape[1]}")
        send1, send2 = self.exchange1.send[:n], self.exchange2.send[:n]
        lse, value = self.lse[:n], self.value[:n]
        ops.score_stats(logits, targets, self.vocab_start, self.local_valid, send1)
        e1_all = self.exchange1.gather(rows=n)
        ops.score_candidates(logits, targets, e1_all, self.shard_starts, self.vocab_start,
                             self.local_valid, self.normalize, lse, value, send2)
        e2_all = self.exchange2.gather(rows=n)
        ops.score_merge(e2_all, targets, value, out)
        return out
