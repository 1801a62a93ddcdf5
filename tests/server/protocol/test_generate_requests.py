"""launch.generate (offline) takes the server's request bodies: a text prompt, chat messages,
and the engine's token-id form, in one batch with bad requests that get their own error
object while the others are answered. Oracle: transformers on the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server.helpers import (
    ROOT,
    TOLERANCE,
    chat_prompt_ids,
    encoder,
    hf_rows,
    token_id_of,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the garden"}]


@pytest.fixture(scope="module")
def batch(tmp_path_factory, model_dirs):
    """The requests, and launch.generate's output for them (TP1, one process)."""
    work = tmp_path_factory.mktemp("generate")
    greedy = {"temperature": 0, "return_tokens_as_token_ids": True}
    requests = [
        {"prompt": "The garden", "max_tokens": 5, "logprobs": 2, **greedy},
        {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, **greedy},
        {"prompt": "The garden", "max_tokens": 3, "temperature": 9},  # refused: temperature
        {"messages": [{"role": "bad", "content": "x"}], "max_tokens": 2},  # template raises
        {"prompt_ids": [5, 6, 7], "params": {"max_tokens": 3, "temperature": 0.0,
                                             "logprobs": 2}},
        {"prompt_ids": [5, 6, 7], "params": {"max_tokens": 3, "no_such_field": 1}},
        {"prompt": "The garden", "max_tokens": 2, "stream": True},  # refused: stream
    ]
    (work / "in.json").write_text(json.dumps(requests))
    done = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.generate", "--model",
         str(model_dirs["byte_level"]), "--requests", str(work / "in.json"), "--output",
         str(work / "out.json"), "--max-num-seqs", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    out = json.loads((work / "out.json").read_text())
    assert out["healthy"] and len(out["results"]) == len(requests)
    return requests, out["results"]


def check_greedy(model_dir, prompt_ids: list[int], generated: list[int],
                 values: list[float]) -> None:
    rows = hf_rows(model_dir, prompt_ids, generated)
    for j, token_id in enumerate(generated):
        assert abs(values[j] - float(rows[j, token_id])) <= TOLERANCE
        assert float(rows[j, token_id]) >= float(rows[j].max()) - TOLERANCE  # greedy


def test_a_text_prompt_gets_text_and_logprobs(batch, model_dirs):
    model_dir = model_dirs["byte_level"]
    choice = batch[1][0]["choices"][0]
    lp = choice["logprobs"]
    generated = [token_id_of(t) for t in lp["tokens"]]
    assert len(generated) == 5 and choice["finish_reason"] == "length"
    check_greedy(model_dir, encoder(model_dir).encode("The garden").ids, generated,
                 lp["token_logprobs"])
    assert choice["text"] == encoder(model_dir).decode(generated, skip_special_tokens=True)
    assert all(len(top) >= 2 for top in lp["top_logprobs"])


def test_chat_messages_get_the_templated_prompt_and_the_message(batch, model_dirs):
    model_dir = model_dirs["byte_level"]
    body = batch[1][1]
    assert body["object"] == "chat.completion"
    entries = body["choices"][0]["logprobs"]["content"]
    generated = [token_id_of(e["token"]) for e in entries]
    check_greedy(model_dir, chat_prompt_ids(model_dir, MESSAGES), generated,
                 [e["logprob"] for e in entries])
    assert body["usage"]["prompt_tokens"] == len(chat_prompt_ids(model_dir, MESSAGES))
    text = encoder(model_dir).decode(generated, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize(("index", "param", "words"), [
    (2, "temperature", "temperature"),
    (3, "messages", "role bad is not allowed"),
    (5, "params", "no_such_field"),
    (6, "stream", "stream"),
])
def test_a_bad_request_gets_its_own_error_and_the_batch_is_answered(batch, index, param,
                                                                     words):
    error = batch[1][index]["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError", error
    assert error["param"] == param and words in error["message"], error


def test_the_token_id_form_is_answered_as_before_with_its_text(batch, model_dirs):
    model_dir = model_dirs["byte_level"]
    result = batch[1][4]
    generated = [t["token_id"] for t in result["tokens"]]
    assert len(generated) == 3 and result["finish"]["reason"] == "length"
    check_greedy(model_dir, [5, 6, 7], generated, [t["logprob"] for t in result["tokens"]])
    assert result["text"] == encoder(model_dir).decode(generated, skip_special_tokens=True)
