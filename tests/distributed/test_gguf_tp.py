"""A GGUF checkpoint sharded over two ranks: each rank reads its own rows and columns of the
quantized, llama.cpp-permuted tensors, and its logits shard equals the same slice of
transformers' logits on that file (``gguf_file=``). Two files: Q8_0/Q4_0/Q4_1 and friends
(tests/gguf_files.py) and the K-quants Q4_K, Q5_K, Q6_K as raw blocks (tests/gguf_kquants.py)."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.collectives.groups import world_group
from helios_logprobs.launch.gguf_folder import prepare_gguf_folder
from helios_logprobs.ranks.model import ShardedCausalLM
from tests.distributed.harness import run_ranks
from tests.gguf_files import VOCAB, random_llama_gguf
from tests.gguf_kquants import random_kquant_llama_gguf
from tests.oracles import TOLERANCE

TOKENS = [5, 17, 200, 3, 99, 250, 7, 1, 64, 311]

pytestmark = pytest.mark.slow


def rank_main(folder: str) -> dict:
    model = ShardedCausalLM.load(folder, world_group())
    model.allocate_cache(1, 32)
    n = len(TOKENS)
    logits = model(torch.tensor(TOKENS), torch.arange(n), torch.zeros(n, dtype=torch.long),
                   torch.arange(n))
    return {"bounds": (model.vocab_start, model.local_valid), "logits": logits}


@pytest.mark.parametrize("write", [random_llama_gguf, random_kquant_llama_gguf],
                         ids=["legacy-quants", "k-quants"])
def test_two_ranks_match_transformers_slices(tmp_path, write):
    from transformers import AutoModelForCausalLM

    path = write(tmp_path)
    folder = prepare_gguf_folder(path, tmp_path / "cache")
    oracle = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        expected = oracle(torch.tensor([TOKENS])).logits[0]
    per_rank = run_ranks(rank_main, 2, str(folder), timeout_s=120.0)
    covered = 0
    for rank in range(2):
        start, valid = per_rank[rank]["bounds"]
        torch.testing.assert_close(per_rank[rank]["logits"][:, :valid],
                                   expected[:, start:start + valid], atol=TOLERANCE,
                                   rtol=TOLERANCE)
        covered += valid
    assert covered == VOCAB
