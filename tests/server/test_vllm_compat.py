"""Assertions of vLLM's own server tests (tests/entrypoints/openai/) that this server failed,
replayed with the official `openai` client: stream_options defaults, the refusals' wording that
vLLM's clients and tests match, every bad logit_bias key named at once."""

from __future__ import annotations

import openai
import pytest

from tests.server.helpers import post, served_name, strict_json

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def _completion_chunks(server, stream_options: dict) -> list:
    client = server.client()
    return list(client.completions.create(
        model=served_name(server), prompt="What is the capital of France?", max_tokens=5,
        temperature=0.0, stream=True, stream_options=stream_options,
        extra_body={"ignore_eos": True}))


def _chat_chunks(server, stream_options: dict) -> list:
    client = server.client()
    return list(client.chat.completions.create(
        model=served_name(server), messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
        stream=True, stream_options=stream_options, extra_body={"ignore_eos": True}))


@pytest.mark.parametrize("stream_options", [
    {},  # vLLM's StreamOptions.include_usage defaults to False (test_completion_stream_options)
    {"include_usage": False, "continuous_usage_stats": True},  # per-chunk usage needs both
    {"include_usage": False},
])
@pytest.mark.parametrize("chunks_of", [_completion_chunks, _chat_chunks])
def test_stream_options_without_include_usage_send_no_usage(server, stream_options, chunks_of):
    chunks = chunks_of(server, stream_options)
    assert chunks and all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


@pytest.mark.parametrize("chunks_of", [_completion_chunks, _chat_chunks])
def test_include_usage_with_continuous_stats_still_reports(server, chunks_of):
    chunks = chunks_of(server, {"include_usage": True, "continuous_usage_stats": True})
    assert all(chunk.usage is not None for chunk in chunks)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert final.usage.total_tokens == final.usage.prompt_tokens + 5


def test_logit_bias_names_every_bad_key(server):
    """test_chat_logit_bias_multiple_non_integer_keys: both keys in one 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=served_name(server), messages=MESSAGES, max_tokens=5,
            logit_bias={"bad1": 50.0, "bad2": 20.0})
    error = caught.value
    assert error.status_code == 400 and error.body["param"] == "logit_bias"
    assert "bad1" in error.message and "bad2" in error.message


@pytest.mark.parametrize("seed, kind", [(-(2**63) - 1, "greater_than_equal"),
                                        (2**63, "less_than_equal")])
def test_seed_out_of_int64_names_the_pydantic_error_type(server, seed, kind):
    """test_chat.py::test_long_seed matches pydantic's error type in the message."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=served_name(server), messages=MESSAGES, temperature=0, seed=seed)
    assert caught.value.body["param"] == "seed"
    assert kind in caught.value.message


EMPTY = "Either prompt or prompt_embeds must be provided and non-empty."


@pytest.mark.parametrize("prompt", ["", [], [[]], [[1, 2], []], [""], None, "absent"])
def test_empty_or_missing_prompt_uses_vllm_wording(server, prompt):
    """test_prompt_validation.py / test_empty_prompt_list.py match this sentence."""
    body = {"model": served_name(server), "max_tokens": 2}
    if prompt != "absent":
        body["prompt"] = prompt
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = strict_json(response.content)["error"]
    assert error == {"message": EMPTY, "type": "BadRequestError", "param": "prompt", "code": 400}


@pytest.mark.parametrize("prompt", [[999_999], [5, -1]])
def test_out_of_vocabulary_prompt_ids_use_vllm_wording(server, prompt):
    """test_prompt_validation.py::test_out_of_vocab_token_ids matches "out of vocabulary"."""
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as info:
        server.client().completions.create(model=served_name(server), prompt=prompt,
                                           max_tokens=2)
    assert info.value.body["param"] == "prompt"
