"""Model recipes: Llama, Mistral, Qwen2 and Qwen3 with tensor-parallel sharded weights and a
per-slot KV cache."""

from __future__ import annotations

from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.errors import (
    ModelConfigError,
    UnsupportedModelError,
    WeightLoadError,
)
from helios_logprobs.ranks.model.llama import KVCache, ShardedCausalLM
from helios_logprobs.ranks.model.sharding import ShardLayout, head_shard, shard_layout, vocab_shard

__all__ = [
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "ShardLayout",
    "ShardedCausalLM",
    "UnsupportedModelError",
    "WeightLoadError",
    "head_shard",
    "shard_layout",
    "vocab_shard",
]
