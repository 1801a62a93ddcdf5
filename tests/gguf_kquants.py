"""GGUF files whose linear weights are K-quants (Q4_K, Q5_K, Q6_K), which the ``gguf`` package
cannot quantize to: their blocks are written raw, random bytes with finite, small fp16 scales
(where gguf-py's quants.py reads them), for a random Llama with several 256-wide blocks per row."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.gguf_files import VOCAB, write_gguf

Q = gguf.GGMLQuantizationType
QK_K = 256
K_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
           "ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q4_K, "token_embd": Q.Q6_K,
           "output": Q.Q5_K}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 512, 768, 8, 4
"""Two or three 256-wide blocks per row; at TP2 o_proj splits on a block boundary, down_proj
in the middle of one."""
_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
"""Byte offsets of each block's fp16 scales: d and dmin first (Q4_K, Q5_K), d last (Q6_K)."""
_SPREAD = {Q.Q4_K: 200.0, Q.Q5_K: 400.0, Q.Q6_K: 1400.0}
"""About the standard deviation of a block's values in units of d, for random quants."""


def random_k_blocks(shape: tuple[int, ...], qtype: Q, std: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Raw blocks (uint8, ``[rows, cols / 256 * type_size]``) of random quants and scales
    ``d``, ``dmin`` in ``[0.5, 1.5] * std / spread``, so values have about ``std``."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert block == QK_K and cols % block == 0, (shape, qtype)
    blocks = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scale = std / _SPREAD[qtype] * rng.uniform(0.5, 1.5, size=(rows, cols // block))
        blocks[:, :, offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_wide_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=512, rope_theta=5000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def random_kquant_llama_gguf(root: Path, seed: int = 7) -> Path:
    """A random Llama (hidden 512, intermediate 768) whose q/k/v/o, MLP, embedding and head
    are Q4_K/Q5_K/Q6_K blocks (K_TYPES); the norms stay F32. The head's values are 8 times
    wider, so distributions are peaked as a trained model's."""
    rng = np.random.default_rng(seed)

    def encode(array: np.ndarray, qtype: Q) -> np.ndarray:
        if qtype not in _SCALE_OFFSETS:
            return gguf.quants.quantize(array, qtype)
        std = 0.02 * (8.0 if array.shape[0] == VOCAB else 1.0)
        return random_k_blocks(array.shape, qtype, std, rng)

    return write_gguf(write_wide_llama(root / "hf"), root / "kquant-llama.gguf",
                      types=K_TYPES, encode=encode)
