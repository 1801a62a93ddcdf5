"""Model recipes: Llama, Mistral, Qwen2 and Qwen3 with tensor-parallel sharded weights and a
per-slot KV cache."""

from __future__ import annotations

from ranks.model.config import ModelConfig
from ranks.model.errors import ModelConfigError, UnsupportedModelError
from ranks.model.llama import KVCache, ShardedCausalLM
from ranks.model.sharding import ShardLayout, head_shard, shard_layout, vocab_shard
from ranks.model.weights import WeightLoadError

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
