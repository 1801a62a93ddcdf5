"""The engine end to end at TP1 and TP4 (gloo, real ZeroMQ), against transformers."""

from __future__ import annotations

import json
import math

import pytest

from tests.checkpoints import hf_logprobs, write_llama, write_qwen2
from tests.distributed.launcher import run_ranks

TOL = 1e-4

SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 11,
           "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2}


def requests(vocab: int) -> list[dict]:
    shard = -(-vocab // 4)
    owned_by_each_rank = [1, shard + 3, 2 * shard + 5, vocab - 1]
    reqs = [
        {"prompt_ids": [5, 6, 7, 8, 9, 10], "params": {"max_tokens": 8, "temperature": 0.0,
                                                       "logprobs": 20}},
        {"prompt_ids": [3, 9, 27, 81], "params": {"max_tokens": 8, **SAMPLED, "logprobs": 5}},
        {"prompt_ids": [3, 9, 27, 81], "params": {"max_tokens": 8, **SAMPLED}},
        {"prompt_ids": [40, 41], "params": {"max_tokens": 6, "temperature": 1.0, "seed": 5,
                                            "min_p": 0.05,
                                            "logprob_token_ids": owned_by_each_rank[::-1]}},
        {"prompt_ids": list(range(20, 90)), "params": {"max_tokens": 5, "temperature": 0.7,
                                                       "seed": 3, "logprobs": 0}},
        {"prompt_ids": [7], "params": {"max_tokens": 4, "temperature": 0.0}},
    ]
    for req in reqs:
        req["params"]["ignore_eos"] = True
    return reqs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return write_llama(path) if request.param == "llama" else write_qwen2(path)


def generate(model_dir, world: int, tmp_path, reqs: list[dict]) -> dict:
    req_file, out_file = tmp_path / f"req{world}.json", tmp_path / f"out{world}.json"
    req_file.write_text(json.dumps(reqs))
    run_ranks("helios_logprobs.launch.generate",
              ["--model", str(model_dir), "--requests", str(req_file), "--output", str(out_file),
               "--capacity", "4", "--chunk-size", "32"], world)
    return json.loads(out_file.read_text())


def reference_ranking(row) -> list[tuple[int, float]]:
    pairs = sorted(((-float(v), i) for i, v in enumerate(row.tolist())))
    return [(i, -v) for v, i in pairs]


def check_against_transformers(model_dir, reqs, results) -> None:
    for req, result in zip(reqs, results, strict=True):
        assert "error" not in result, result
        tokens = result["tokens"]
        assert len(tokens) >= 1
        params = req["params"]
        prompt = req["prompt_ids"]
        seq = prompt + [t["token_id"] for t in tokens]
        ref = hf_logprobs(model_dir, seq)
        for t in tokens:
            row = ref[len(prompt) + t["index"] - 1]
            if "logprobs" not in params and "logprob_token_ids" not in params:
                assert t["logprob"] is None and t["alternatives"] == []
                continue
            assert math.isclose(t["logprob"], float(row[t["token_id"]]), abs_tol=TOL)
            alts = t["alternatives"]
            if "logprob_token_ids" in params:
                assert [a[0] for a in alts] == params["logprob_token_ids"]
                for tid, value in alts:
                    assert math.isclose(value, float(row[tid]), abs_tol=TOL)
                continue
            n = params["logprobs"]
            assert len(alts) == n
            ranking = reference_ranking(row)
            for tid, value in alts:
                assert math.isclose(value, float(row[tid]), abs_tol=TOL)
            assert alts == sorted(alts, key=lambda a: (-a[1], a[0]))
            if n:
                cutoff = alts[-1][1]
                must = {i for i, v in ranking if v > cutoff + TOL}
                assert must <= {a[0] for a in alts}


def test_engine_tp1_and_tp4_match_transformers(checkpoint, tmp_path):
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    reqs = requests(vocab)
    tp1 = generate(checkpoint, 1, tmp_path, reqs)
    tp4 = generate(checkpoint, 4, tmp_path, reqs)
    for out in (tp1, tp4):
        assert out["healthy"]
        check_against_transformers(checkpoint, reqs, out["results"])
    for a, b in zip(tp1["results"], tp4["results"], strict=True):
        # Seeded and greedy requests sample the same tokens at TP1 and TP4.
        assert [t["token_id"] for t in a["tokens"]] == [t["token_id"] for t in b["tokens"]]
    with_lp, without_lp = tp1["results"][1], tp1["results"][2]
    assert [t["token_id"] for t in with_lp["tokens"]] == [
        t["token_id"] for t in without_lp["tokens"]
    ]
