"""--compile through the server (issue 36), TP1 (the TP2 compiled step, with the same mix of
work, is tests/distributed/test_compiled_reduction_tp.py): a concurrent run mixing decode,
chunked prefill, scored prefill (prompt_logprobs), selected ids, logprobs on and off, entropy
(whose submissions take the eager reduction) and speculative rounds compiles nothing after
start-up (helios:compile_recompilations_total on /metrics stays 0, with the start-up graphs
counted, the forward's, the sample phase's, prompt scoring's and the reduce phase's, and no
graph break), and answers what the --enforce-eager server answers (the same tokens, logprobs
within 1e-5)."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.helpers import launch, post, strict_json

pytestmark = pytest.mark.slow

COMMON = ["--capacity", "4", "--chunk-size", "8", "--speculative-tokens", "2",
          "--ngram-min", "1", "--prompt-logprobs"]
LONG = "the cat sat on the mat and the cat sat on the hat " * 2


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    model = model_dirs["byte_level"]
    started = [launch("eager", model, 1, [*COMMON, "--enforce-eager"], root),
               launch("compiled_tp1", model, 1, [*COMMON, "--compile"], root)]
    try:
        for server in started:
            server.wait_healthy()
        yield started
    finally:
        for server in started:
            server.stop()


def bodies(name: str) -> list[dict]:
    common = {"model": name, "ignore_eos": True}
    return [
        {**common, "prompt": LONG, "max_tokens": 12, "temperature": 0.0, "logprobs": 5},
        {**common, "prompt": "abcabcabcabc", "max_tokens": 16, "temperature": 0.0},
        {**common, "prompt": "0101010101", "max_tokens": 14, "temperature": 0.9, "seed": 7,
         "top_p": 0.9, "top_k": 20, "logprobs": 0, "return_entropy": True},
        {**common, "prompt": "xyzxyz", "max_tokens": 10, "temperature": 0.0,
         "logprobs": 0, "logprob_token_ids": [1, 2, 3, 40]},
        {**common, "prompt": LONG[:30], "max_tokens": 6, "temperature": 0.0,
         "prompt_logprobs": 2, "logprobs": 1},
        {**common, "prompt": "hello hello hello", "max_tokens": 12, "temperature": 0.7,
         "seed": 3, "min_p": 0.05, "repetition_penalty": 1.1},
    ]


def answers(server) -> list[dict]:
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda b: post(server, "/v1/completions", b),
                                  bodies(server.model_dir.name)))
    assert all(r.status_code == 200 for r in responses), [
        (r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
    return [strict_json(r.content)["choices"] for r in responses]


def assert_close(a, b, path="") -> None:
    """Equal structures; floats within 1e-5 (the compiled reduction is bit-equal; the
    compiled forward's fused norms and padded attention round differently, and batches may
    form differently between servers)."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-5), (path, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def counters(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return {line.split()[0][len("helios:"):]: float(line.split()[1])
            for line in text.splitlines() if line.startswith("helios:compile_")}


def test_compiled_servers_answer_what_eager_answers_and_compile_nothing_while_serving(servers):
    eager, *compiled = servers
    expected = answers(eager)
    entropy = expected[2][0]["logprobs"]["entropy"]  # (its submissions reduce eagerly)
    assert len(entropy) == 14 and all(e > 0 for e in entropy), entropy
    for server in compiled:
        for _ in range(2):
            assert_close(answers(server), expected)
    time.sleep(1.5)  # (the core reports its counters at least every 0.5 s)
    assert counters(eager)["compile_graphs_total"] == 0
    for server in compiled:
        seen = counters(server)
        assert seen["compile_recompilations_total"] == 0, server.name
        # forward x2, sample x5 (one row, sampled or greedy; the dynamic batch filtered,
        # sampled or greedy), prompt scoring's block, reduce
        assert seen["compile_graphs_total"] == 9, server.name
        assert seen["compile_graph_breaks_total"] == 0, server.name
    text = httpx.get(eager.url + "/metrics", timeout=5).text
    assert "helios:device_memory_bytes" not in text  # (the CPU: no device allocator)
