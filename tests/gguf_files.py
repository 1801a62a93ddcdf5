"""GGUF files written here as llama.cpp's converter writes them: a random transformers Llama
with q/k rows permuted and one quantization type per tensor kind (tests of ranks/model/gguf.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from helios_logprobs.ranks.model.gguf import hf_name
from tests.checkpoints import write_llama, write_qwen2

Q = gguf.GGMLQuantizationType
VOCAB = 320
TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.F16,
         "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.F32, "token_embd": Q.F16,
         "output": Q.Q8_0}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf_dir: Path, path: Path, arch: str = "llama", rope_theta: float = 5000.0,
               types: dict[str, Q] | None = None,
               encode: Callable[[np.ndarray, Q], np.ndarray] = gguf.quants.quantize) -> Path:
    """``hf_dir``'s checkpoint as llama.cpp writes it (q/k permuted for llama only): a 2-D
    tensor of kind ``k`` (``attn_q``, ``token_embd``, ...) as ``types[k]`` (default TYPES, F32
    if absent) through ``encode(array, qtype)``, which returns its raw blocks."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [chr(0x21 + i) if i < 94 else f"t{i}" for i in range(VOCAB)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    gguf_names = {hf_name(n): n for n in _gguf_names(config)}
    for name, tensor in state.items():
        array = tensor.float().numpy()
        target = gguf_names[name]
        permuted = arch == "llama"  # llama.cpp's LlamaModel.permute; Qwen2Model keeps rows
        if permuted and ".attn_q." in target:
            array = permute(array, config["num_attention_heads"])
        elif permuted and ".attn_k." in target:
            array = permute(array, config["num_key_value_heads"])
        kind = target.split(".")[-2]
        qtype = (TYPES if types is None else types).get(kind, Q.F32) if array.ndim == 2 else Q.F32
        data = encode(array, qtype)
        writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_names(config: dict) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    parts = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
             "ffn_up", "ffn_down")
    for layer in range(config["num_hidden_layers"]):
        names += [f"blk.{layer}.{part}.weight" for part in parts]
        names += [f"blk.{layer}.{part}.bias" for part in ("attn_q", "attn_k", "attn_v")]
    return names


def random_llama_gguf(root: Path) -> Path:
    """A random Llama (tests/checkpoints.py write_llama, vocabulary VOCAB) as a GGUF file."""
    return write_gguf(write_llama(root / "hf", vocab_size=VOCAB), root / "random-llama.gguf")


def random_qwen2_gguf(root: Path) -> Path:
    """A random Qwen2 (write_qwen2: tied embeddings, qkv bias) as a GGUF file."""
    return write_gguf(write_qwen2(root / "hf", vocab_size=VOCAB), root / "random-qwen2.gguf",
                      arch="qwen2", rope_theta=20000.0)
