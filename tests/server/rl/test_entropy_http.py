"""``return_entropy`` (SGLang's name) through the HTTP API at TP1 and TP2 (the tiny model's
vocabulary, 321, leaves TP2 a padded lane): each generated position's entropy, on
/v1/completions (``logprobs.entropy``), /v1/chat/completions (``logprobs.content[i].entropy``)
and /inference/v1/generate (each entry's ``entropy``), against the float64 entropy of
transformers' logits of the same checkpoint within 1e-4; streamed equal to whole (exact
FP32 values); absent when not asked for; a non-boolean value, or one without logprobs, is a
400 naming ``return_entropy``."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.checkpoints import _hf_model
from tests.devices import missing_gpus
from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    launch,
    post,
    sse_events,
    strict_json,
    token_id_of,
    write_model,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 77, 130, 42, 9, 250, 18, 77]
MESSAGES = [{"role": "user", "content": "entropy, please"}]
SAMPLING = {"temperature": 0.9, "top_k": 40, "seed": 3, "ignore_eos": True}
MAX_TOKENS = 6
SERVERS = {"t1": 1, "t2": 2}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("entropy")
    model = write_model(root / "model", "byte_level")
    common = ["--capacity", "4", "--generation-config", "vllm"]
    started = {name: launch(f"entropy_{name}", model, tp, common, root)
               for name, tp in SERVERS.items() if missing_gpus(tp) is None}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(params=sorted(SERVERS))
def server(request, servers):
    name = request.param
    if name not in servers:
        pytest.skip(missing_gpus(SERVERS[name]) or "not started")
    servers[name].wait_healthy()
    return servers[name]


def reference_entropy(model_dir, prompt: list[int], generated: list[int]) -> list[float]:
    """float64 entropy of transformers' logits at each generated position."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt + generated])).logits[0]
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(generated)].double()
    logp = torch.log_softmax(rows, dim=-1)
    return (-(logp.exp() * logp).sum(-1)).tolist()


def check_against_reference(server, prompt, ids, entropy) -> None:
    assert len(entropy) == len(ids) == MAX_TOKENS
    want = reference_entropy(server.model_dir, prompt, ids)
    for got, expected in zip(entropy, want, strict=True):
        assert isinstance(got, float) and abs(got - expected) <= TOLERANCE, (got, expected)


def completions(server, stream: bool = False, **fields):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": 2,
            "return_tokens_as_token_ids": True, "stream": stream, **SAMPLING, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return sse_events(response) if stream else strict_json(response.content)


def test_completions_entropy_against_transformers(server):
    logprobs = completions(server, return_entropy=True)["choices"][0]["logprobs"]
    ids = [token_id_of(t) for t in logprobs["tokens"]]
    check_against_reference(server, PROMPT, ids, logprobs["entropy"])
    streamed = [e for event in completions(server, stream=True, return_entropy=True)
                for choice in event["choices"] if choice["logprobs"]
                for e in choice["logprobs"]["entropy"]]
    assert streamed == logprobs["entropy"]
    plain = completions(server)["choices"][0]["logprobs"]
    assert "entropy" not in plain and plain["tokens"] == logprobs["tokens"]
    assert plain["token_logprobs"] == logprobs["token_logprobs"]


def chat(server, stream: bool = False, **fields):
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "logprobs": True,
            "top_logprobs": 2, "return_tokens_as_token_ids": True, "stream": stream,
            **SAMPLING, **fields}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return sse_events(response) if stream else strict_json(response.content)


def test_chat_entropy_against_transformers(server):
    content = chat(server, return_entropy=True)["choices"][0]["logprobs"]["content"]
    ids = [token_id_of(e["token"]) for e in content]
    prompt = chat_prompt_ids(server.model_dir, MESSAGES)
    check_against_reference(server, prompt, ids, [e["entropy"] for e in content])
    streamed = [e for event in chat(server, stream=True, return_entropy=True)
                for choice in event["choices"] if choice.get("logprobs")
                for e in choice["logprobs"]["content"]]
    assert streamed == content
    assert all("entropy" not in e for e in chat(server)["choices"][0]["logprobs"]["content"])


def generate(server, stream: bool = False, **sampling):
    body = {"token_ids": PROMPT, "stream": stream, "sampling_params": {
        "max_tokens": MAX_TOKENS, "logprobs": 2, **SAMPLING, **sampling}}
    response = post(server, "/inference/v1/generate", body)
    assert response.status_code == 200, response.text
    return sse_events(response) if stream else strict_json(response.content)


def test_generate_entropy_against_transformers(server):
    choice = generate(server, return_entropy=True)["choices"][0]
    content = choice["logprobs"]["content"]
    check_against_reference(server, PROMPT, choice["token_ids"],
                            [e["entropy"] for e in content])
    streamed = [e for event in generate(server, stream=True, return_entropy=True)
                for c in event["choices"] if c.get("logprobs")
                for e in c["logprobs"]["content"]]
    assert [e["entropy"] for e in streamed] == [e["entropy"] for e in content]
    assert all("entropy" not in e for e in generate(server)["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_non_boolean_is_refused(servers, value):
    server = servers.get("t1") or pytest.skip("not started")
    server.wait_healthy()
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "return_entropy": value}),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                  "return_entropy": value}),
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "logprobs": 1, "return_entropy": value}}),
    ):
        response = post(server, path, body)
        assert response.status_code == 400, (path, response.text)
        error = strict_json(response.content)["error"]
        # (generate names the nested model as its param, the field in its message)
        assert error["param"] in ("return_entropy", "sampling_params"), response.text
        assert "return_entropy" in error["message"] or error["param"] == "return_entropy"


def test_without_logprobs_is_refused(servers):
    server = servers.get("t1") or pytest.skip("not started")
    server.wait_healthy()
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "return_entropy": True}),
        ("/v1/chat/completions", {"messages": MESSAGES, "return_entropy": True}),
        ("/inference/v1/generate", {"token_ids": PROMPT,
                                    "sampling_params": {"return_entropy": True}}),
    ):
        response = post(server, path, body)
        assert response.status_code == 400, (path, response.text)
        assert "return_entropy" in strict_json(response.content)["error"]["param"], \
            response.text


def test_a_stop_entry_has_its_entropy(server):
    """generate reports the terminating stop token's entry (vLLM's stop entry): with
    return_entropy it has the entropy of its position, the first of a greedy run here."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    first = generate(server, return_entropy=True, **greedy)["choices"][0]
    stop = first["token_ids"][0]
    choice = generate(server, return_entropy=True, stop_token_ids=[stop], **greedy)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [stop]
    [entry] = choice["logprobs"]["content"]
    assert entry["entropy"] == first["logprobs"]["content"][0]["entropy"]


def test_responses_entropy_with_the_openai_client(server):
    """/v1/responses takes return_entropy as chat does (the official client's extra_body):
    each output_text entry carries its position's entropy, equal to the chat entry of the
    same seeded request (its tokens' entropy against transformers), streamed as whole; absent
    when not asked; without the logprobs include, or not a boolean, a 400 naming it."""
    body = chat(server, return_entropy=True, **{"ignore_eos": False})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) > 2, body  # (no early end: the comparisons below are not vacuous)
    ids = [token_id_of(e["token"]) for e in content]
    want = reference_entropy(server.model_dir, chat_prompt_ids(server.model_dir, MESSAGES), ids)
    for entry, expected in zip(content, want, strict=True):
        assert abs(entry["entropy"] - expected) <= TOLERANCE, (entry, expected)
    client = server.client()
    seeded = {"top_k": SAMPLING["top_k"], "seed": SAMPLING["seed"]}
    asked = dict(model=client.models.list().data[0].id, input=MESSAGES[0]["content"],
                 max_output_tokens=MAX_TOKENS, top_logprobs=2, temperature=0.9,
                 extra_body={**seeded, "return_entropy": True})
    response = client.responses.create(**asked, include=["message.output_text.logprobs"])
    entries = [e.model_dump() for e in response.output[0].content[0].logprobs]
    assert [(e["logprob"], e["entropy"]) for e in entries] == [
        (e["logprob"], e["entropy"]) for e in content]
    assert all("entropy" not in top for e in entries for top in e["top_logprobs"])
    with client.responses.stream(**asked) as events:
        streamed = [e.model_dump()["entropy"] for event in events
                    if event.type == "response.output_text.delta" for e in event.logprobs]
    assert streamed == [e["entropy"] for e in content]
    plain = client.responses.create(**{**asked, "extra_body": seeded})
    assert all("entropy" not in e.model_dump() for e in plain.output[0].content[0].logprobs)
    for extra, fields in (({"return_entropy": True}, {"top_logprobs": 0}),
                          ({"return_entropy": "yes"}, {})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**{**asked, **fields, "extra_body": extra})
        assert refused.value.body["param"] == "return_entropy", refused.value.body
