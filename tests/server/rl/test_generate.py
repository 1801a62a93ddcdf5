"""POST /inference/v1/generate (vLLM's token-in/token-out endpoint) against two oracles:
/v1/completions on the same server for the same prompt ids and sampling (ids and logprobs
equal bit for bit: one engine, one validation path) and transformers' FP32 log_softmax of
the same checkpoint (within 1e-4)."""

from __future__ import annotations

import pytest

from tests.server.helpers import (
    TOLERANCE,
    hf_rows,
    post,
    same,
    sse_events,
    strict_json,
    token_id_of,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 77, 130, 42, 9, 250, 18]


def generate(server, stream: bool = False, **sampling) -> dict | list:
    body = {"token_ids": PROMPT, "stream": stream, "sampling_params": sampling}
    response = post(server, "/inference/v1/generate", body)
    assert response.status_code == 200, response.text
    return sse_events(response) if stream else strict_json(response.content)


def completion(server, n: int = 1, **fields) -> dict:
    body = {"prompt": PROMPT, "n": n, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "echo": False, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return strict_json(response.content)


def entries(choice: dict) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(token_id_of(e["token"]), e["logprob"],
             [(token_id_of(t["token"]), t["logprob"]) for t in e["top_logprobs"]])
            for e in choice["logprobs"]["content"]]


def completion_entries(choice: dict, k: int) -> list[tuple[int, float, list]]:
    """(id, logprob, natural top-k) per completions entry: the dict holds the chosen id
    first, then the top-k without repeating it."""
    out = []
    logprobs = choice["logprobs"]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs["top_logprobs"], strict=True):
        chosen = token_id_of(token)
        pairs = [(token_id_of(key), v) for key, v in top.items()]
        natural = sorted(pairs, key=lambda p: (-p[1], p[0]))[:k] if len(pairs) > k else pairs
        out.append((chosen, value, natural))
    return out


def test_greedy_ids_and_logprobs_equal_completions_and_transformers(rl_a1):
    got = generate(rl_a1, temperature=0.0, max_tokens=12, logprobs=4, ignore_eos=True)
    choice = got["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 12
    assert got["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 12,
                            "total_tokens": len(PROMPT) + 12}
    mine = entries(choice)
    assert [e[0] for e in mine] == choice["token_ids"]
    reference = completion(rl_a1, temperature=0.0, max_tokens=12, logprobs=4,
                           ignore_eos=True)["choices"][0]
    assert reference["token_ids"] == choice["token_ids"]
    theirs = completion_entries(reference, 4)
    for (tid, value, top), (ref_id, ref_value, ref_top) in zip(mine, theirs, strict=True):
        assert (tid, value) == (ref_id, ref_value)  # bit for bit
        assert sorted(top) == sorted(ref_top) and len(top) == 4
    rows = hf_rows(rl_a1.model_dir, PROMPT, choice["token_ids"])
    for row, (tid, value, top) in zip(rows, mine, strict=True):
        assert int(row.argmax()) == tid
        assert abs(float(row[tid]) - value) <= TOLERANCE
        expected = row.topk(4)
        assert [t for t, _ in top] == expected.indices.tolist()
        for (_, v), ev in zip(top, expected.values.tolist(), strict=True):
            assert abs(v - ev) <= TOLERANCE


def test_seeded_choices_equal_completions(rl_a1):
    sampling = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 11, "max_tokens": 10,
                "logprobs": 2, "ignore_eos": True}
    got = generate(rl_a1, n=2, **sampling)
    reference = completion(rl_a1, n=2, **sampling)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for mine, theirs in zip(got["choices"], reference["choices"], strict=True):
        assert mine["token_ids"] == theirs["token_ids"]
        assert [e[1] for e in entries(mine)] == theirs["logprobs"]["token_logprobs"]
    assert got["choices"][0]["token_ids"] != got["choices"][1]["token_ids"]


def test_top_logprobs_list_the_sampled_token_first_as_vllm(rl_a1):
    """vLLM's generate (_create_tokens_logprobs): the first max(N, 1) items of {sampled id,
    then the top N}: the sampled token, then the most likely others (a sampled id outside
    the top N leaves out the N-th); logprobs=0 lists the sampled token alone."""
    sampling = {"temperature": 1.5, "seed": 4, "max_tokens": 12, "ignore_eos": True}
    outside = 0
    for n in (2, 0):
        got = generate(rl_a1, logprobs=n, **sampling)["choices"][0]
        reference = completion(rl_a1, logprobs=max(n, 1), **sampling)["choices"][0]
        assert got["token_ids"] == reference["token_ids"]
        for (tid, value, top), (_, _, natural) in zip(
                entries(got), completion_entries(reference, max(n, 1)), strict=True):
            ranked = sorted(natural, key=lambda p: (-p[1], p[0]))
            assert top == [(tid, value), *[p for p in ranked if p[0] != tid]][: max(n, 1)]
            outside += n > 0 and tid not in [t for t, _ in ranked]
    assert outside > 0  # (a sampled id outside the top 2 was seen: its case is covered)


def test_a_stop_token_is_returned_with_its_logprob(rl_a1):
    first = generate(rl_a1, temperature=0.0, max_tokens=6, logprobs=1,
                     ignore_eos=True)["choices"][0]
    stop = first["token_ids"][2]
    got = generate(rl_a1, temperature=0.0, max_tokens=6, logprobs=1,
                   stop_token_ids=[stop])["choices"][0]
    # vLLM's output ids hold the stop token; its entry is scored like any other.
    assert got["finish_reason"] == "stop"
    assert got["token_ids"] == first["token_ids"][: first["token_ids"].index(stop) + 1]
    assert entries(got) == entries(first)[: len(got["token_ids"])]


def test_streamed_chunks_add_up_to_the_whole_response(rl_a1):
    sampling = {"temperature": 0.0, "max_tokens": 9, "logprobs": 3, "ignore_eos": True}
    whole = generate(rl_a1, **sampling)["choices"][0]
    response = post(rl_a1, "/inference/v1/generate",
                    {"token_ids": PROMPT, "stream": True, "sampling_params": sampling,
                     "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    events = sse_events(response)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert all(len(c["token_ids"]) == 1 for c in chunks)
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [e for c in chunks for e in c["logprobs"]["content"]] == \
        whole["logprobs"]["content"]
    assert [c["finish_reason"] for c in chunks] == [None] * 8 + ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9


def test_without_logprobs_only_ids_come_back(rl_a1):
    got = generate(rl_a1, temperature=0.0, max_tokens=5, ignore_eos=True)["choices"][0]
    reference = completion(rl_a1, temperature=0.0, max_tokens=5, ignore_eos=True)
    assert got["logprobs"] is None
    assert got["token_ids"] == reference["choices"][0]["token_ids"]


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [10**6], "sampling_params": {}}, "token_ids"),
    ({"token_ids": PROMPT, "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"token_ids": PROMPT, "sampling_params": {"logprobs": 10**4}},
     "sampling_params.logprobs"),
    ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 10**5}},
     "sampling_params.max_tokens"),
    ({"token_ids": PROMPT, "sampling_params": {"stop": ["x"]}}, "sampling_params.stop"),
    ({"token_ids": PROMPT, "sampling_params": {"n": 2, "temperature": 0.0}},
     "sampling_params.n"),
    ({"token_ids": PROMPT, "sampling_params": {"stop_token_ids": [-3]}},
     "sampling_params.stop_token_ids"),
    ({"token_ids": PROMPT}, "sampling_params"),
])
def test_refusals_name_the_parameter(rl_a1, body, param):
    response = post(rl_a1, "/inference/v1/generate", body)
    assert response.status_code == 400, response.text
    assert strict_json(response.content)["error"]["param"] == param


def test_prompt_logprobs_equal_completions(scoring_server):
    sampling = {"temperature": 0.0, "max_tokens": 1, "prompt_logprobs": 2}
    got = generate(scoring_server, **sampling)["prompt_logprobs"]
    reference = completion(scoring_server, **sampling)["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT) == len(reference)
    for mine, theirs in zip(got[1:], reference[1:], strict=True):
        assert list(mine) == list(theirs)  # the prompt token's id, then its alternatives
        for key, item in mine.items():
            assert item["decoded_token"] == f"token_id:{key}"
            assert item["rank"] == theirs[key]["rank"]
            assert same(item["logprob"], theirs[key]["logprob"])


def test_streamed_choices_and_a_stop_token_equal_the_whole_response(rl_a1):
    sampling = {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 8, "logprobs": 1,
                "ignore_eos": True}
    free = generate(rl_a1, **sampling)["choices"][0]["token_ids"]
    sampling["stop_token_ids"] = [free[2]]  # (choice 0 stops there: same seed, same tokens)
    whole = generate(rl_a1, **sampling)["choices"]
    assert whole[0]["finish_reason"] == "stop"
    events = generate(rl_a1, stream=True, **sampling)
    for choice in whole:
        chunks = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
        assert [x for c in chunks for x in c["logprobs"]["content"]] == \
            choice["logprobs"]["content"]
        assert [c["finish_reason"] for c in chunks][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in chunks[:-1])
        if choice["finish_reason"] == "stop":  # (the stop token rides on the last chunk)
            assert chunks[-1]["token_ids"] == [sampling["stop_token_ids"][0]]
