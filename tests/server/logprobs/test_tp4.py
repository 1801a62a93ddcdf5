"""A TP4 server (torchrun, gloo) on the byte-fallback model: logprobs equal transformers'."""

from __future__ import annotations

import pytest

from tests.oracles import check_natural
from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    encoder,
    expected_offsets,
    hf_rows,
    natural_from_dict,
    post,
    served_name,
    strict_json,
    token_id_of,
    vocab_bytes,
)

pytestmark = pytest.mark.slow


def test_tp4_completion_and_chat_logprobs(tp4_server):
    server, name = tp4_server, served_name(tp4_server)
    prompt_ids = encoder(server.model_dir).encode("Hello world, the café 中文").ids
    table = vocab_bytes(server.model_dir)
    for n, sampling in [(5, {"temperature": 0.0}), (20, {"temperature": 1.0, "seed": 3})]:
        response = post(server, "/v1/completions", {
            "model": name, "prompt": prompt_ids, "max_tokens": 10, "logprobs": n,
            "return_tokens_as_token_ids": True, "ignore_eos": True, **sampling,
        })
        choice = strict_json(response.content)["choices"][0]
        lp = choice["logprobs"]
        generated = [token_id_of(t) for t in lp["tokens"]]
        rows = hf_rows(server.model_dir, prompt_ids, generated)
        for j, token_id in enumerate(generated):
            assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
            check_natural(natural_from_dict(lp["top_logprobs"][j], token_id, n), rows[j], n)
        pieces = [table[i] for i in generated]
        if not set(generated) & {0, 1, 2}:  # no skipped special tokens
            assert lp["text_offset"] == expected_offsets(pieces)

    messages = [{"role": "user", "content": "  emoji 🙂 and naïve words  "}]
    chat_ids = chat_prompt_ids(server.model_dir, messages)
    response = server.client().chat.completions.create(
        model=name, messages=messages, max_tokens=10, logprobs=True, top_logprobs=5,
        temperature=0.0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert response.usage.prompt_tokens == len(chat_ids)
    content = response.choices[0].logprobs.content
    generated = [token_id_of(c.token) for c in content]
    rows = hf_rows(server.model_dir, chat_ids, generated)
    for j, item in enumerate(content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
        assert bytes(item.bytes) == table[generated[j]]
        check_natural([(token_id_of(a.token), a.logprob) for a in item.top_logprobs], rows[j], 5)

    selected = [430, 0, 7, 215, 3]
    response = server.client().chat.completions.create(
        model=name, messages=messages, max_tokens=3, logprobs=True, temperature=0.0,
        extra_body={"ignore_eos": True, "logprob_token_ids": selected,
                    "return_tokens_as_token_ids": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 3
    generated = [token_id_of(c.token) for c in content]
    rows = hf_rows(server.model_dir, chat_ids, generated)
    for j, item in enumerate(content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
        assert [token_id_of(a.token) for a in item.top_logprobs] == selected
        assert [a.logprob for a in item.top_logprobs] == pytest.approx(
            [float(rows[j, t]) for t in selected], abs=TOLERANCE
        )
