"""--logprobs-mode through the HTTP API: servers at TP1 and TP2 (the tiny model's vocabulary,
321, leaves TP2 a padded lane) with processed_logprobs, and one with processed_logits,
against transformers' logits of the same checkpoint with vLLM's processors applied in its
order (tests/sampler_oracle.py: penalties, temperature, min-p, top-k, top-p) and renormalized
in float64; raw_logits at TP2 with prompt scoring reports transformers' logits at generated
and prompt positions (vLLM: prompt positions follow logits vs logprobs only). A masked-out
alternative is sent as -9999.0; a refused mode is one
``helios: error:`` line and exit status 2."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from helios_logprobs.ranks.sampler.params import RowSampling
from tests import sampler_oracle as oracle
from tests.checkpoints import _hf_model
from tests.devices import missing_gpus
from tests.server.helpers import (
    ROOT,
    TOLERANCE,
    launch,
    post,
    strict_json,
    token_id_of,
    write_model,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 77, 130, 42, 9, 250, 18, 77]
COMMON = ["--capacity", "4", "--generation-config", "vllm"]
SERVERS = {"p1": ("processed_logprobs", 1), "p2": ("processed_logprobs", 2),
           "l1": ("processed_logits", 1), "r2": ("raw_logits", 2)}
EXTRA = {"r2": ["--prompt-logprobs"]}
SAMPLING = {
    "filtered": dict(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.3, seed=11),
    "min_p": dict(temperature=1.5, min_p=0.2, frequency_penalty=0.4, seed=5),
    "greedy": dict(temperature=0.0, presence_penalty=0.7),
}
MAX_TOKENS = 6
TOP = 8
WIRE_FLOOR = -9999.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs-mode")
    model = write_model(root / "model", "byte_level")
    started = {name: launch(f"mode_{name}", model, tp,
                            [*COMMON, "--logprobs-mode", mode, *EXTRA.get(name, [])], root)
               for name, (mode, tp) in SERVERS.items() if missing_gpus(tp) is None}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


def ready(servers: dict, name: str):
    if name not in servers:
        pytest.skip(missing_gpus(SERVERS[name][1]) or "not started")
    servers[name].wait_healthy()
    return servers[name]


def complete(server, sampling: dict) -> tuple[list[int], list[float], list[dict[int, float]]]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": TOP, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **sampling}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    logprobs = strict_json(response.content)["choices"][0]["logprobs"]
    ids = [token_id_of(t) for t in logprobs["tokens"]]
    tops = [{token_id_of(k): v for k, v in top.items()} for top in logprobs["top_logprobs"]]
    return ids, logprobs["token_logprobs"], tops


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' FP32 logits: row i predicts ids[i + 1]."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def processed_rows(model_dir, generated: list[int], sampling: dict) -> list[torch.Tensor]:
    """The oracle: transformers' FP32 logits of each generated position through vLLM's
    processors (float32, dropped ids -inf)."""
    logits = hf_logits(model_dir, PROMPT + generated)
    params = {k: v for k, v in sampling.items() if k != "seed"}
    rows = []
    for j in range(len(generated)):
        row = RowSampling(seed=sampling.get("seed", 0), position=j, **params)
        rows.append(oracle.final(logits[len(PROMPT) - 1 + j], row, PROMPT, generated[:j]))
    return rows


def check_processed(server, sampling: dict, normalized: bool) -> list[int]:
    ids, values, tops = complete(server, sampling)
    rows = processed_rows(server.model_dir, ids, sampling)
    masked = 0
    for token, value, top, y in zip(ids, values, tops, rows, strict=True):
        want = y.to(torch.float64)
        if normalized:
            want = want - torch.logsumexp(want, 0)
        assert math.isfinite(want[token])
        assert abs(value - float(want[token])) <= TOLERANCE, (token, value, float(want[token]))
        assert len(top) in (TOP, TOP + 1) and top[token] == value
        for alt, got in top.items():
            if math.isinf(want[alt]):
                assert got == WIRE_FLOOR, (alt, got)
                masked += 1
            else:
                assert abs(got - float(want[alt])) <= TOLERANCE, (alt, got, float(want[alt]))
        best = sorted(range(want.numel()), key=lambda i: (-float(want[i]), i))[:TOP]
        finite = [i for i in best if math.isfinite(want[i])]
        assert set(finite) <= set(top), (finite, top)
    if "top_k" in sampling:
        assert masked == MAX_TOKENS * (TOP - sampling["top_k"])
    return ids


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_processed_logprobs_at_tp1(servers, case: str):
    check_processed(ready(servers, "p1"), SAMPLING[case], normalized=True)


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_processed_logprobs_at_tp2_equal_tp1(servers, case: str):
    ids = check_processed(ready(servers, "p2"), SAMPLING[case], normalized=True)
    assert ids == complete(ready(servers, "p1"), SAMPLING[case])[0]


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_processed_logits(servers, case: str):
    check_processed(ready(servers, "l1"), SAMPLING[case], normalized=False)


def test_raw_logits_at_generated_and_prompt_positions(servers):
    server = ready(servers, "r2")
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": TOP, "prompt_logprobs": 3,
            "ignore_eos": True, "return_tokens_as_token_ids": True,
            **SAMPLING["filtered"]}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = strict_json(response.content)["choices"][0]
    ids = [token_id_of(t) for t in choice["logprobs"]["tokens"]]
    logits = hf_logits(server.model_dir, PROMPT + ids)
    for j, (token, value, top) in enumerate(zip(ids, choice["logprobs"]["token_logprobs"],
                                                choice["logprobs"]["top_logprobs"],
                                                strict=True)):
        row = logits[len(PROMPT) - 1 + j]
        assert abs(value - float(row[token])) <= TOLERANCE
        best = row.topk(TOP).indices.tolist()
        assert {token_id_of(k) for k in top} - {token} <= set(best)
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        row = logits[position - 1]
        for key, entry in prompt[position].items():
            assert abs(entry["logprob"] - float(row[int(key)])) <= TOLERANCE, (position, key)
            assert entry["rank"] == int((row > row[int(key)]).sum()) + 1


def test_an_unknown_mode_is_refused_at_start_up():
    done = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.serve", "--logprobs-mode", "processed"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("helios: error:"), lines
    assert "--logprobs-mode" in lines[0]


def float64_entropy(row: torch.Tensor) -> float:
    """-sum p log p of a processed row in float64; its -inf lanes weigh 0."""
    logp = row.to(torch.float64) - torch.logsumexp(row.to(torch.float64), 0)
    terms = torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp))
    return float(-terms.sum())


@pytest.mark.parametrize("name", ["p1", "p2"])
@pytest.mark.parametrize("case", ["filtered", "greedy"])
def test_return_entropy_is_the_processed_distributions(servers, name: str, case: str):
    server = ready(servers, name)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": 1, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "return_entropy": True, **SAMPLING[case]}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    logprobs = strict_json(response.content)["choices"][0]["logprobs"]
    ids = [token_id_of(t) for t in logprobs["tokens"]]
    rows = processed_rows(server.model_dir, ids, SAMPLING[case])
    for got, row in zip(logprobs["entropy"], rows, strict=True):
        assert abs(got - float64_entropy(row)) <= TOLERANCE, (got, float64_entropy(row))
    if case == "filtered":  # (top-k 6 keeps at most 6 tokens: the entropy is at most log 6)
        assert all(h <= math.log(SAMPLING[case]["top_k"]) + TOLERANCE
                   for h in logprobs["entropy"])
