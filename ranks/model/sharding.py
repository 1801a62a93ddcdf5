"""Tensor-parallel shard math (Megatron style): the heads, MLP columns and vocabulary ids of a rank.

Attention is split by heads. The query heads must divide evenly across the group. Key/value heads
are split when the group size divides them; when the group is larger (and a multiple of their
count) each rank holds a replica of the one KV head its query heads read, so every rank keeps
whole GQA groups. The vocabulary is padded to ``ceil(vocab / tp) * tp``: rank r owns global ids
``[r * shard, (r + 1) * shard)`` and lanes at or past ``vocab_size`` are padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from helios_logprobs.ranks.model.config import ModelConfig


@dataclass(frozen=True)
class ShardLayout:
    tp_size: int
    tp_rank: int
    head_start: int
    local_heads: int
    kv_head_start: int
    local_kv_heads: int
    intermediate_start: int
    local_intermediate: int
    vocab_size: int
    vocab_start: int
    local_width: int
    local_valid: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"rank {self.tp_rank} outside tensor-parallel group {self.tp_size}")
        if min(self.local_heads, self.local_kv_heads, self.local_intermediate) < 1:
            raise ValueError(f"empty shard: {self}")
        if not 0 < self.local_valid <= self.local_width:
            raise ValueError(f"local_valid {self.local_valid} outside (0, {self.local_width}]")
        if self.vocab_start + self.local_valid > self.vocab_size:
            raise ValueError(f"vocabulary shard passes vocab_size {self.vocab_size}")

    @property
    def padded_vocab(self) -> int:
        return self.local_width * self.tp_size

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.local_valid


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(vocab_start, local_width, local_valid) of rank ``tp_rank``'s vocabulary shard."""
    width = -(-vocab_size // tp_size)
    start = tp_rank * width
    valid = min(width, vocab_size - start)
    if valid <= 0:
        raise ValueError(
            f"vocabulary of {vocab_size} leaves rank {tp_rank} of {tp_size} without real ids"
        )
    return start, width, valid


def head_shard(
    num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int
) -> tuple[int, int, int, int]:
    """(head_start, local_heads, kv_head_start, local_kv_heads) for one rank."""
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads {num_heads} is not divisible by tensor-parallel size {tp_size}"
        )
    local_heads = num_heads // tp_size
    head_start = tp_rank * local_heads
    if num_kv_heads % tp_size == 0:
        local_kv = num_kv_heads // tp_size
        return head_start, local_heads, tp_rank * local_kv, local_kv
    if tp_size % num_kv_heads == 0:
        return head_start, local_heads, tp_rank * num_kv_heads // tp_size, 1
    raise ValueError(
        f"num_key_value_heads {num_kv_heads} neither divides nor is divisible by "
        f"tensor-parallel size {tp_size}"
    )


def column_shard(size: int, tp_size: int, tp_rank: int, name: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(f"{name} {size} is not divisible by tensor-parallel size {tp_size}")
    local = size // tp_size
    return tp_rank * local, local


def shard_layout(config: ModelConfig, tp_size: int, tp_rank: int) -> ShardLayout:
    head_start, local_heads, kv_start, local_kv = head_shard(
        config.num_attention_heads, config.num_key_value_heads, tp_size, tp_rank
    )
    inter_start, local_inter = column_shard(
        config.intermediate_size, tp_size, tp_rank, "intermediate_size"
    )
    vocab_start, width, valid = vocab_shard(config.vocab_size, tp_size, tp_rank)
    return ShardLayout(
        tp_size=tp_size,
        tp_rank=tp_rank,
        head_start=head_start,
        local_heads=local_heads,
        kv_head_start=kv_start,
        local_kv_heads=local_kv,
        intermediate_start=inter_start,
        local_intermediate=local_inter,
        vocab_size=config.vocab_size,
        vocab_start=vocab_start,
        local_width=width,
        local_valid=valid,
    )
