from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helios_logprobs.ranks.model import (
    ModelConfig,
    ShardedCausalLM,
    UnsupportedModelError,
    WeightLoadError,
    head_shard,
    shard_layout,
    vocab_shard,
)
from helios_logprobs.ranks.model.rope import RopeScaling
from helios_logprobs.runtime.engine.config import RuntimeConfig
from tests.oracles import (
    TOLERANCE,
    build_checkpoint,
    expected_rows,
    llama_kwargs,
    qwen2_kwargs,
    reference_logits,
    run_schedule,
    schedule,
    sequence_tokens,
)


@pytest.mark.parametrize(
    ("family", "max_shard_size", "rope"),
    [
        ("llama", None, None),
        ("qwen2", None, None),
        ("llama", "40KB", None),
        ("llama", None, "linear"),
        ("llama", None, "llama3"),
        ("qwen2", None, "yarn"),
        ("qwen3", None, None),
        ("mistral", None, None),
    ],
)
def test_tp1_logits_match_transformers(
    tmp_path: Path, family: str, max_shard_size: str | None, rope: str | None
):
    model_dir = build_checkpoint(tmp_path / family, family, max_shard_size, rope)
    if max_shard_size is not None:
        assert (model_dir / "model.safetensors.index.json").is_file()
    model = ShardedCausalLM.load(model_dir)
    tokens = sequence_tokens(model.vocab_size)
    reference = reference_logits(model_dir, tokens)
    assert (model.vocab_start, model.local_valid) == (0, model.vocab_size)
    assert model.local_width == model.vocab_size
    for step, logits in zip(schedule(tokens), run_schedule(model, tokens), strict=True):
        assert logits.dtype == torch.float32
        assert logits.shape == (len(step.expected), model.vocab_size)
        torch.testing.assert_close(
            logits, expected_rows(step, reference), atol=TOLERANCE, rtol=TOLERANCE
        )


def test_config_reads_transformers_json(tmp_path: Path):
    llama = ModelConfig.from_model_dir(build_checkpoint(tmp_path / "l", "llama"))
    assert (llama.architecture, llama.rope_theta, llama.head_dim) == ("llama", 5000.0, 24)
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias and not llama.tie_word_embeddings
    qwen = ModelConfig.from_model_dir(build_checkpoint(tmp_path / "q", "qwen2"))
    assert (qwen.architecture, qwen.vocab_size, qwen.head_dim) == ("qwen2", 301, 8)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings


def legacy_config(**overrides) -> dict:
    raw = dict(llama_kwargs(), architectures=["LlamaForCausalLM"], eos_token_id=[2, 5])
    raw.update(overrides)
    return raw


def test_config_legacy_fields_and_errors():
    config = ModelConfig.from_dict(legacy_config(rope_scaling=None, bos_token_id=1))
    assert config.rope_theta == 5000.0 and config.eos_token_ids == (2, 5)
    assert config.bos_token_id == 1
    plain = {"rope_theta": 2.5e5, "rope_type": "default"}
    assert ModelConfig.from_dict(legacy_config(rope_parameters=plain)).rope_theta == 2.5e5
    no_theta = {k: v for k, v in legacy_config().items() if k != "rope_theta"}
    assert ModelConfig.from_dict(no_theta).rope_theta == 10000.0
    with pytest.raises(UnsupportedModelError, match="'dynamic'.*linear, llama3, yarn"):
        ModelConfig.from_dict(legacy_config(rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_dict(legacy_config(rope_parameters={"rope_type": "longrope"}))
    with pytest.raises(ValueError, match="rope_scaling.factor must be a number, got '8'"):
        ModelConfig.from_dict(legacy_config(rope_scaling={"rope_type": "llama3", "factor": "8"}))
    with pytest.raises(ValueError, match="needs a 'factor'"):
        ModelConfig.from_dict(legacy_config(rope_scaling={"rope_type": "linear"}))
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        ModelConfig.from_dict(legacy_config(rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4, "high_freq_factor": 1}))


def test_config_reads_rope_scaling_as_checkpoints_write_it():
    """Llama 3.2's config.json (rope_scaling with the theta beside it), a legacy "type" key, and
    yarn's defaults (transformers': original length = max_position_embeddings)."""
    llama32 = ModelConfig.from_dict(legacy_config(rope_theta=5e5, max_position_embeddings=131072,
                                                  rope_scaling={
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}))
    assert llama32.rope_theta == 5e5
    assert llama32.rope_scaling == RopeScaling("llama3", 32.0, 8192, 1.0, 4.0)
    legacy = ModelConfig.from_dict(legacy_config(rope_scaling={"type": "linear", "factor": 4}))
    assert legacy.rope_scaling == RopeScaling("linear", 4.0, 128)
    yarn = ModelConfig.from_dict(legacy_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    assert yarn.rope_scaling.original_max_position_embeddings == 128
    plain = ModelConfig.from_dict(legacy_config(rope_scaling={"rope_type": "default"}))
    assert plain.rope_scaling is None
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_dict(legacy_config(use_sliding_window=True))
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        ModelConfig.from_dict(legacy_config(layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(UnsupportedModelError, match="GemmaForCausalLM"):
        ModelConfig.from_dict(legacy_config(architectures=["GemmaForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_dict(legacy_config(architectures=[], model_type="gemma"))
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_dict(legacy_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict(legacy_config(num_key_value_heads=3))


def test_a_mistral_sliding_window_is_served_only_where_it_never_binds(tmp_path: Path):
    """Mistral v0.1 declares a 4096-token window: the default context stops there, a longer
    one is refused before anything is allocated, and a cache longer than it is refused."""
    mistral = dict(legacy_config(architectures=["MistralForCausalLM"], sliding_window=24,
                                 max_position_embeddings=128, attention_bias=True))
    config = ModelConfig.from_dict(mistral)
    assert config.sliding_window == 24 and not (config.qkv_bias or config.mlp_bias)
    assert RuntimeConfig(model_dir=tmp_path).resolve_max_model_len(config) == 24
    assert RuntimeConfig(model_dir=tmp_path, max_model_len=16).resolve_max_model_len(config) == 16
    with pytest.raises(ValueError, match="max_model_len 64 exceeds the checkpoint's "
                                         "sliding_window 24"):
        RuntimeConfig(model_dir=tmp_path, max_model_len=64).resolve_max_model_len(config)
    unbounded = ModelConfig.from_dict({**mistral, "sliding_window": None})
    assert RuntimeConfig(model_dir=tmp_path).resolve_max_model_len(unbounded) == 128
    model = ShardedCausalLM.load(build_checkpoint(tmp_path / "m", "mistral"))
    assert model.config.sliding_window == 32
    with pytest.raises(UnsupportedModelError, match="max_model_len must be <= 32, got 33"):
        model.allocate_cache(capacity=1, max_seq_len=33)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_dict({**mistral, "sliding_window": 0})


def test_qwen_sliding_windows_stay_refused():
    qwen = dict(qwen2_kwargs(), architectures=["Qwen3ForCausalLM"], use_sliding_window=True,
                sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_dict(qwen)
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None


def test_shard_math():
    assert [vocab_shard(301, 4, r) for r in range(4)] == [
        (0, 76, 76),
        (76, 76, 76),
        (152, 76, 76),
        (228, 76, 73),
    ]
    assert vocab_shard(301, 1, 0) == (0, 301, 301)
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [
        (0, 2, 0, 1),
        (2, 2, 0, 1),
        (4, 2, 1, 1),
        (6, 2, 1, 1),
    ]
    assert head_shard(8, 4, 2, 1) == (4, 4, 2, 2)
    with pytest.raises(ValueError, match="num_attention_heads 6"):
        head_shard(6, 2, 4, 0)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        head_shard(12, 3, 2, 0)
    with pytest.raises(ValueError, match="without real ids"):
        vocab_shard(5, 4, 3)
    config = ModelConfig.from_dict(legacy_config(intermediate_size=90))
    with pytest.raises(ValueError, match="intermediate_size 90"):
        shard_layout(config, 4, 0)


def rewrite_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_weight_load_errors(tmp_path: Path):
    model_dir = build_checkpoint(tmp_path / "q", "qwen2")
    name = "model.layers.1.self_attn.k_proj.weight"

    def truncate(tensors: dict) -> None:
        tensors[name] = tensors[name][:-8].clone()

    rewrite_tensors(model_dir, truncate)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\[24, 64\].*\[32, 64\]"):
        ShardedCausalLM.load(model_dir)

    def drop(tensors: dict) -> None:
        del tensors[name]
        del tensors["model.norm.weight"]

    rewrite_tensors(model_dir, drop)
    with pytest.raises(WeightLoadError, match=r"missing tensor 'model\.layers\.1.*\[32, 64\]"):
        ShardedCausalLM.load(model_dir)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        ShardedCausalLM.load(model_dir)


def test_missing_shard_file_and_untied_head(tmp_path: Path):
    model_dir = build_checkpoint(tmp_path / "l", "llama", max_shard_size="40KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    (model_dir / index["weight_map"]["lm_head.weight"]).unlink()
    with pytest.raises(WeightLoadError, match="missing"):
        ShardedCausalLM.load(model_dir)


def test_forward_validates_inputs(tmp_path: Path):
    model = ShardedCausalLM.load(build_checkpoint(tmp_path / "q", "qwen2"))
    ids = torch.tensor([1, 2], dtype=torch.int64)
    pos = torch.tensor([0, 1], dtype=torch.int64)
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="allocate_cache"):
        model.forward(ids, pos, slots, pos)
    model.allocate_cache(capacity=2, max_seq_len=4)
    assert model.cache.keys[0].shape == (2, 4, 4, 8)
    with pytest.raises(ValueError, match="positions"):
        model.forward(ids, pos + 3, slots, pos)
    with pytest.raises(ValueError, match="slots"):
        model.forward(ids, pos, slots + 2, pos)
    with pytest.raises(ValueError, match="input ids"):
        model.forward(ids + 300, pos, slots, pos)
    with pytest.raises(ValueError, match="logit_indices"):
        model.forward(ids, pos, slots, pos + 1)
    with pytest.raises(ValueError, match="same"):
        model.forward(ids, pos * 0, slots, pos)
    assert model.forward(ids, pos, slots, pos[:0]).shape == (0, 301)


def test_bfloat16_weights_and_logits(tmp_path: Path):
    model_dir = build_checkpoint(tmp_path / "l", "llama")
    full = ShardedCausalLM.load(model_dir)
    half = ShardedCausalLM.load(model_dir, dtype=torch.bfloat16)
    assert half.weights.layers[0].qkv.dtype == torch.bfloat16
    tokens = sequence_tokens(full.vocab_size)
    for a, b in zip(run_schedule(full, tokens), run_schedule(half, tokens), strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, atol=0.15, rtol=0.05)
