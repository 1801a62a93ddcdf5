"""GGUF weights: a random transformers Llama written as llama.cpp's converter writes it (q/k rows
permuted, one quantization type per tensor kind), read back by ranks/model/gguf.py. The oracle
is transformers loading the same file (``gguf_file=``): its dequantized, unpermuted weights
and its logits. Each TP2 rank's slices equal the full tensor's rows or columns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios_logprobs.launch.gguf_folder import prepare_gguf_folder
from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.gguf import GGUF_FILE, GGUFCheckpointReader
from tests.gguf_files import VOCAB, random_llama_gguf, random_qwen2_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return random_llama_gguf(tmp_path_factory.mktemp("gguf"))


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


def test_a_qwen2_file_tied_with_qkv_bias_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = random_qwen2_gguf(tmp_path)
    oracle = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    folder = prepare_gguf_folder(path, tmp_path / "cache")
    model = ShardedCausalLM.load(folder, dtype=torch.float32)
    assert model.config.architecture == "qwen2" and model.config.tie_word_embeddings
    model.allocate_cache(1, 32)
    ids = [5, 17, 200, 3, 99, 250, 7, 1]
    n = len(ids)
    logits = model(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long),
                   torch.arange(n))[:, :VOCAB]
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits[0]
    assert (logits.log_softmax(-1) - expected.log_softmax(-1)).abs().max() <= 1e-5
