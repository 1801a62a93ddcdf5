"""truncate_prompt_tokens / truncation_side (vLLM's): the engine sees only the kept tokens, so
usage, echo, prompt logprobs and every generated logprob are those of the truncated prompt
(transformers on the kept ids is the oracle), and a text longer than the context is accepted
when truncation makes it fit."""

from __future__ import annotations

import math

import pytest

from tests.server.helpers import (
    MAX_MODEL_LEN,
    TOLERANCE,
    encoder,
    hf_rows,
    post,
    served_name,
    strict_json,
)

pytestmark = pytest.mark.slow

TEXT = "The garden was quiet in the early morning light"


def complete(server, **fields) -> dict:
    body = {"model": served_name(server), "max_tokens": 3, "temperature": 0.0,
            "logprobs": 2, "return_tokens_as_token_ids": True, **fields}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return strict_json(response.content)


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_generation_sees_only_the_kept_tokens(scoring_server, side):
    server = scoring_server
    ids = encoder(server.model_dir).encode(TEXT, add_special_tokens=True).ids
    kept = ids[:4] if side == "right" else ids[-4:]
    fields = {} if side is None else {"truncation_side": side}
    body = complete(server, prompt=TEXT, truncate_prompt_tokens=4, echo=True, **fields)
    assert body["usage"]["prompt_tokens"] == 4
    lp = body["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert tokens[:4] == kept and lp["token_logprobs"][0] is None  # echoed, kept prompt
    generated = tokens[4:]
    rows = hf_rows(server.model_dir, kept, generated)
    for j, (token, row) in enumerate(zip(generated, rows, strict=True)):
        assert math.isclose(lp["token_logprobs"][4 + j], float(row[token]), abs_tol=TOLERANCE)
    same = complete(server, prompt=kept, echo=True)
    assert same["choices"][0]["logprobs"]["tokens"] == lp["tokens"]


def test_a_text_longer_than_the_context_fits_once_truncated(server):
    long_text = "word " * (4 * MAX_MODEL_LEN)
    refused = post(server, "/v1/completions", {"model": served_name(server),
                                               "prompt": long_text, "max_tokens": 1})
    assert refused.status_code == 400
    body = complete(server, prompt=long_text, truncate_prompt_tokens=MAX_MODEL_LEN - 8,
                    max_tokens=1)
    assert body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 8
    short = complete(server, prompt=TEXT, truncate_prompt_tokens=-1)  # -1: the context length
    assert short["usage"]["prompt_tokens"] == len(
        encoder(server.model_dir).encode(TEXT, add_special_tokens=True).ids)


def test_chat_truncation_keeps_the_conversation_tail(server):
    response = post(server, "/v1/chat/completions", {
        "model": served_name(server), "max_tokens": 2, "truncate_prompt_tokens": 5,
        "messages": [{"role": "user", "content": TEXT}]})
    assert response.status_code == 200, response.text
    assert strict_json(response.content)["usage"]["prompt_tokens"] == 5
