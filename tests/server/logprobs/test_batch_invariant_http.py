"""--batch-invariant through the server: the same concurrent requests against speculation off
and on (history proposals, N = 4) return byte-identical choices, logprobs included."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.helpers import launch, post, strict_json

pytestmark = pytest.mark.slow

PROMPTS = ["abcabcabcabcab", "the cat and the cat and the", "xyz", "0101010101", "hello"]


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant")
    common = ["--capacity", "4", "--batch-invariant"]
    started = [launch("invariant_off", model_dirs["byte_level"], 1, common, root),
               launch("invariant_on", model_dirs["byte_level"], 1,
                      [*common, "--speculative-tokens", "4", "--ngram-min", "1"], root)]
    try:
        for server in started:
            server.wait_healthy()
        yield started
    finally:
        for server in started:
            server.stop()


def bodies(server) -> list[dict]:
    name = server.model_dir.name
    greedy = [{"model": name, "prompt": p, "max_tokens": 24, "temperature": 0.0,
               "logprobs": 5, "ignore_eos": True} for p in PROMPTS]
    seeded = [{"model": name, "prompt": p, "max_tokens": 20, "temperature": 0.9, "seed": 7,
               "top_p": 0.95, "logprobs": 2, "ignore_eos": True} for p in PROMPTS[:3]]
    return greedy + seeded


def choices(server) -> list[list[dict]]:
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda b: post(server, "/v1/completions", b), bodies(server)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [strict_json(r.content)["choices"] for r in responses]


def test_speculation_on_and_off_return_identical_choices(servers):
    off, on = servers
    expected = choices(off)
    assert choices(on) == expected
    assert choices(off) == expected  # and the off server agrees with itself under load
    chat = {"model": off.model_dir.name, "messages": [{"role": "user", "content": "abab" * 4}],
            "max_tokens": 16, "temperature": 0.0, "logprobs": True, "top_logprobs": 3}
    answers = [strict_json(post(s, "/v1/chat/completions", chat).content)["choices"]
               for s in servers]
    assert answers[0] == answers[1]
    assert len(answers[0][0]["logprobs"]["content"]) == 16
    drafts, accepted = (metric(on, "spec_decode_num_draft_tokens_total"),
                        metric(on, "spec_decode_num_accepted_tokens_total"))
    assert 0 < accepted <= drafts  # rounds ran, and some proposals were accepted
    assert metric(off, "spec_decode_num_draft_tokens_total") == 0


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f"helios:{name} "))
