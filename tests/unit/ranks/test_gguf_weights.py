"""GGUF weights: a random transformers Llama written as llama.cpp's converter writes it (q/k rows
permuted, one quantization type per tensor kind), read back by ranks/model/gguf.py. The oracle
is transformers loading the same file (``gguf_file=``): its dequantized, unpermuted weights
and its logits. Each TP2 rank's slices equal the full tensor's rows or columns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helios_logprobs.launch.gguf_folder import prepare_gguf_folder
from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.gguf import GGUF_FILE, GGUFCheckpointReader, hf_name
from tests.checkpoints import write_llama

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
VOCAB = 320
TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.F16,
         "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.F32, "token_embd": Q.F16,
         "output": Q.Q8_0}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf_dir: Path, path: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("random llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(5000.0)  # write_llama's rope_theta
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
        if ".attn_q." in target:
            array = permute(array, config["num_attention_heads"])
        elif ".attn_k." in target:
            array = permute(array, config["num_key_value_heads"])
        kind = target.split(".")[-2]
        qtype = TYPES.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(target, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_names(config: dict) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    parts = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
             "ffn_up", "ffn_down")
    for layer in range(config["num_hidden_layers"]):
        names += [f"blk.{layer}.{part}.weight" for part in parts]
    return names


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    write_gguf(write_llama(root / "hf", vocab_size=VOCAB), root / "random-llama.gguf")
    return root / "random-llama.gguf"


@pytest.fixture(scope="module")
def oracle(gguf_file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                dtype=torch.float32).eval()


def test_every_tensor_equals_transformers_dequantized_unpermuted(gguf_file, oracle):
    reader = GGUFCheckpointReader(gguf_file)
    for name, expected in oracle.state_dict().items():
        got = reader.read(name, tuple(expected.shape))
        assert torch.equal(got, expected.float()), name


def test_tp2_slices_are_the_full_tensors_rows_and_columns(gguf_file):
    reader = GGUFCheckpointReader(gguf_file)
    q = reader.read("model.layers.0.self_attn.q_proj.weight", (64, 64))
    k = reader.read("model.layers.1.self_attn.k_proj.weight", (32, 64))
    o = reader.read("model.layers.0.self_attn.o_proj.weight", (64, 64))
    down = reader.read("model.layers.0.mlp.down_proj.weight", (64, 128))
    v = reader.read("model.layers.0.self_attn.v_proj.weight", (32, 64))
    for rank in range(2):
        rows, kv_rows, cols = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16), (
            slice(64 * rank, 64 * rank + 64))
        assert torch.equal(reader.read("model.layers.0.self_attn.q_proj.weight", (64, 64), 0,
                                       32 * rank, 32), q[rows])
        assert torch.equal(reader.read("model.layers.1.self_attn.k_proj.weight", (32, 64), 0,
                                       16 * rank, 16), k[kv_rows])
        assert torch.equal(reader.read("model.layers.0.self_attn.o_proj.weight", (64, 64), 1,
                                       32 * rank, 32), o[:, rows])
        assert torch.equal(reader.read("model.layers.0.mlp.down_proj.weight", (64, 128), 1,
                                       64 * rank, 64), down[:, cols])
        assert torch.equal(reader.read("model.layers.0.self_attn.v_proj.weight", (32, 64), 1,
                                       16 * rank + 8, 8), v[:, 16 * rank + 8:16 * rank + 16])


def test_the_served_model_matches_transformers_logits(gguf_file, oracle, tmp_path):
    folder = prepare_gguf_folder(gguf_file, tmp_path / "cache")
    assert (folder / GGUF_FILE).resolve() == gguf_file.resolve()
    model = ShardedCausalLM.load(folder, dtype=torch.float32)
    model.allocate_cache(1, 32)
    ids = [5, 17, 200, 3, 99, 250, 7, 1]
    n = len(ids)
    logits = model(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long),
                   torch.arange(n))[:, :VOCAB]
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits[0]
    assert (logits.log_softmax(-1) - expected.log_softmax(-1)).abs().max() <= 1e-5
