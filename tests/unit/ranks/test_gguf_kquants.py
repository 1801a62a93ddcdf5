"""GGUF K-quants (Q4_K, Q5_K, Q6_K) read by ranks/model/gguf.py: a random Llama whose linear
weights, embedding and head are raw K-quant blocks (tests/gguf_kquants.py), q/k rows in
llama.cpp's permuted order. The oracle is transformers loading the same file (``gguf_file=``):
its dequantized, unpermuted weights and its logits; TP2 slices equal the full tensor's rows or
columns, on and off a 256-wide block boundary."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from helios_logprobs.launch.gguf_folder import prepare_gguf_folder
from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.gguf import GGUFCheckpointReader
from tests.gguf_files import VOCAB
from tests.gguf_kquants import (
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    K_TYPES,
    KV_HEADS,
    random_kquant_llama_gguf,
)

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return random_kquant_llama_gguf(tmp_path_factory.mktemp("gguf-kquant"))


@pytest.fixture(scope="module")
def oracle(gguf_file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                dtype=torch.float32).eval()


def test_the_file_holds_every_k_quant_on_every_linear_weight(gguf_file):
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(gguf_file)).tensors}
    assert set(types.values()) == {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32}
    for name, qtype in types.items():
        kind = name.split(".")[-2]
        assert qtype == K_TYPES.get(kind, Q.F32), name


def test_every_tensor_equals_transformers_dequantized_unpermuted(gguf_file, oracle):
    reader = GGUFCheckpointReader(gguf_file)
    for name, expected in oracle.state_dict().items():
        got = reader.read(name, tuple(expected.shape))
        assert torch.isfinite(got).all() and got.abs().max() < 10.0, name
        assert torch.equal(got, expected.float()), name


def test_tp2_slices_are_the_full_tensors_rows_and_columns(gguf_file):
    reader = GGUFCheckpointReader(gguf_file)
    kv_rows = HIDDEN // HEADS * KV_HEADS
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),        # Q4_K, permuted
        "model.layers.1.self_attn.k_proj.weight": (kv_rows, HIDDEN),       # Q5_K, permuted
        "model.layers.0.self_attn.v_proj.weight": (kv_rows, HIDDEN),       # Q6_K
        "model.layers.0.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),     # Q6_K
        "model.embed_tokens.weight": (VOCAB, HIDDEN),                      # Q6_K
        "lm_head.weight": (VOCAB, HIDDEN),                                 # Q5_K
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),        # Q5_K
        "model.layers.1.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),     # Q4_K
    }
    full = {name: reader.read(name, shape) for name, shape in shapes.items()}
    for name, shape in shapes.items():
        dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
        half = shape[dim] // 2  # o_proj: one whole block; down_proj: 1.5 blocks
        for rank in range(2):
            got = reader.read(name, shape, dim, half * rank, half)
            expected = full[name].narrow(dim, half * rank, half)
            assert torch.equal(got, expected), (name, rank)


def test_the_served_model_matches_transformers_logits(gguf_file, oracle, tmp_path):
    model = ShardedCausalLM.load(prepare_gguf_folder(gguf_file, tmp_path / "cache"),
                                 dtype=torch.float32)
    model.allocate_cache(1, 32)
    ids = [5, 17, 200, 3, 99, 250, 7, 1, 64, 311]
    n = len(ids)
    logits = model(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long),
                   torch.arange(n))[:, :VOCAB]
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits[0]
    assert (logits.log_softmax(-1) - expected.log_softmax(-1)).abs().max() <= 1e-5
