"""Random tiny checkpoints written with transformers, and the transformers oracle."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


def write_llama(path: Path, vocab_size: int = 300) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=5000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    _sharpen(model)
    model.save_pretrained(path)
    return path


def write_qwen2(path: Path, vocab_size: int = 301) -> Path:
    """Tied embeddings, qkv bias, a vocabulary that 4 does not divide."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=20000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config)
    _sharpen(model)
    model.save_pretrained(path)
    return path


def _sharpen(model) -> None:
    """Scale the head so distributions are peaked, like a trained model's, not near-uniform."""
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(8.0)


@lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """FP32 log_softmax of transformers' logits: row i predicts ids[i + 1]."""
    model = _hf_model(str(model_dir))
    logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)
