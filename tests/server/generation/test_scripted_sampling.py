"""min_tokens and bad_words through the server, on a scripted checkpoint whose greedy output
after "ab" is "c" then EOS: a masked id cannot be sampled (the next best raw logit wins), yet
every reported logprob is the raw one from transformers, the masked id among the
alternatives."""

from __future__ import annotations

import math

import pytest
import torch

from tests.scripted_checkpoint import EOS, encode, write_scripted
from tests.server.helpers import hf_rows, launch, post, strict_json

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted_sampling")
    model_dir = write_scripted(root / "model", {"c": EOS})
    server = launch("scripted_sampling", model_dir, 1, ["--capacity", "2"], root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def complete(server, **extra) -> dict:
    body = {"model": server.model_dir.name, "prompt": "ab", "max_tokens": 6,
            "temperature": 0.0, "logprobs": 5, "return_tokens_as_token_ids": True, **extra}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return strict_json(response.content)["choices"][0]


def test_without_min_tokens_the_script_ends_at_eos(scripted_server):
    choice = complete(scripted_server)
    assert (choice["text"], choice["finish_reason"]) == ("c", "stop")


def test_min_tokens_blocks_eos_but_reports_raw_logprobs(scripted_server):
    server = scripted_server
    eos = encode(server.model_dir, EOS)[0]
    choice = complete(server, min_tokens=3)
    lp = choice["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert len(ids) >= 3 and eos not in ids[:3]
    rows = hf_rows(server.model_dir, encode(server.model_dir, "ab"), ids)
    for position, (token, row) in enumerate(zip(ids, rows, strict=True)):
        masked = row.clone()
        if position < 3:
            masked[eos] = -math.inf
        assert token == int(torch.argmax(masked))
        assert math.isclose(lp["token_logprobs"][position], float(row[token]),
                            abs_tol=TOLERANCE)
        for key, value in lp["top_logprobs"][position].items():
            assert math.isclose(value, float(row[int(key.removeprefix("token_id:"))]),
                                abs_tol=TOLERANCE)
    # After "c" the raw argmax is EOS: sampled around, still the best reported alternative.
    assert int(torch.argmax(rows[1])) == eos
    assert f"token_id:{eos}" in lp["top_logprobs"][1]


def test_bad_words_are_never_completed_and_entries_stay_raw(scripted_server):
    server = scripted_server
    banned = encode(server.model_dir, "c")[0]
    choice = complete(server, bad_words=["c"], ignore_eos=True)
    lp = choice["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert len(ids) == 6 and banned not in ids and "c" not in choice["text"]
    rows = hf_rows(server.model_dir, encode(server.model_dir, "ab"), ids)
    for position, (token, row) in enumerate(zip(ids, rows, strict=True)):
        masked = row.clone()
        masked[banned] = -math.inf
        assert token == int(torch.argmax(masked))
        assert math.isclose(lp["token_logprobs"][position], float(row[token]),
                            abs_tol=TOLERANCE)
    # "c" is the raw argmax after "b": masked for sampling, still the best reported entry.
    assert int(torch.argmax(rows[0])) == banned
    assert f"token_id:{banned}" in lp["top_logprobs"][0]
