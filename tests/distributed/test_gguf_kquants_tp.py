"""A K-quant GGUF checkpoint (Q4_K, Q5_K, Q6_K; tests/gguf_kquants.py) sharded over two ranks:
each rank reads its rows and columns of the permuted blocks, and its logits shard equals the
same slice of transformers' logits on that file (``gguf_file=``)."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.launch.gguf_folder import prepare_gguf_folder
from tests.distributed.harness import run_ranks
from tests.distributed.test_gguf_tp import TOKENS, rank_main
from tests.gguf_files import VOCAB
from tests.gguf_kquants import random_kquant_llama_gguf
from tests.oracles import TOLERANCE

pytestmark = pytest.mark.slow


def test_two_ranks_match_transformers_slices(tmp_path):
    from transformers import AutoModelForCausalLM

    path = random_kquant_llama_gguf(tmp_path)
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
