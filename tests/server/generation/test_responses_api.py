"""POST /v1/responses through the official openai client: the output text and its logprob
entries (values against transformers on the ids chat reports), streamed events that add up
to the whole response, and refusals naming the Responses field."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    hf_rows,
    post,
    response_events,
    served_name,
    strict_json,
)

pytestmark = pytest.mark.slow

INCLUDE = ["message.output_text.logprobs"]


def chat_reference(server, messages: list[dict]) -> dict:
    body = {"model": served_name(server), "messages": messages, "max_tokens": 8,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    return strict_json(post(server, "/v1/chat/completions", body).content)


@pytest.mark.parametrize("shape", ["text", "items"])
def test_response_text_and_logprobs(server, shape):
    client = server.client()
    if shape == "text":
        kwargs, messages = {"input": "The garden"}, [{"role": "user", "content": "The garden"}]
    else:
        kwargs = {"instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                         {"type": "input_text", "text": "colour."}]}]}
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a colour."}]
    response = client.responses.create(model=served_name(server), max_output_tokens=8,
                                       temperature=0.0, top_logprobs=3, include=INCLUDE,
                                       **kwargs)
    reference = chat_reference(server, messages)
    choice = reference["choices"][0]
    assert response.output_text == choice["message"]["content"]
    assert response.status == ("incomplete" if choice["finish_reason"] == "length"
                               else "completed")
    assert response.usage.input_tokens == reference["usage"]["prompt_tokens"]
    entries = response.output[0].content[0].logprobs
    assert len(entries) == len(choice["logprobs"]["content"])
    rows = hf_rows(server.model_dir, chat_prompt_ids(server.model_dir, messages),
                   choice["token_ids"])
    for entry, token, row in zip(entries, choice["token_ids"], rows, strict=False):
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=TOLERANCE)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=TOLERANCE)


def test_streamed_events_add_up_to_the_response(server):
    client = server.client()
    kwargs = dict(model=served_name(server), input="Once upon a time", max_output_tokens=6,
                  temperature=0.0, top_logprobs=2, include=INCLUDE)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == whole.output_text
    streamed = [entry for d in deltas for entry in d.logprobs]
    expected = whole.output[0].content[0].logprobs
    # Same tokens; values to FP32 rounding (other requests may share the batches differently).
    assert [e.token for e in streamed] == [e.token for e in expected]
    for got, want in zip(streamed, expected, strict=True):
        assert math.isclose(got.logprob, want.logprob, abs_tol=TOLERANCE)
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_framing_is_openais(server):
    """`event: <type>` before each data line, the type repeated in the data, no [DONE]."""
    body = {"model": served_name(server), "input": "Once upon a time", "max_output_tokens": 3,
            "stream": True}
    response = post(server, "/v1/responses", body)
    assert response.status_code == 200, response.text
    assert "[DONE]" not in response.text
    kinds = [e["type"] for e in response_events(response)]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                              "response.incomplete")


def test_events_and_response_validate_against_openais_models(server):
    """Every streamed event and the whole response, validated strictly by the openai package's
    own pydantic models (the client itself builds them without validation)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": served_name(server), "input": "Once upon a time", "max_output_tokens": 4,
            "temperature": 0.0, "top_logprobs": 2, "include": INCLUDE}
    Response.model_validate(strict_json(post(server, "/v1/responses", body).content))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in response_events(post(server, "/v1/responses", {**body, "stream": True})):
        adapter.validate_python(event)


def test_without_include_no_entries(server):
    response = server.client().responses.create(model=served_name(server), input="Hi",
                                                max_output_tokens=3)
    assert response.output[0].content[0].logprobs == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"top_logprobs": 21, "include": INCLUDE}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),  # (OpenAI's bound holds without the include too)
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_refusals_name_the_field(server, fields, param):
    body = {"model": served_name(server), "input": "Hi", **fields}
    response = post(server, "/v1/responses", body)
    assert response.status_code == 400, response.text
    assert strict_json(response.content)["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        server.client().responses.create(**body)


def test_finished_responses_count_in_metrics(server):
    def finished() -> float:
        text = post_metrics(server)
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("helios:request_success_total{")
                   and 'finished_reason="abort"' not in line)

    before = finished()
    client = server.client()
    client.responses.create(model=served_name(server), input="Hi", max_output_tokens=2)
    list(client.responses.create(model=served_name(server), input="Hi", max_output_tokens=2,
                                 stream=True))
    assert finished() - before >= 2


def post_metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def test_ids_follow_openai(server):
    response = server.client().responses.create(model=served_name(server), input="Hi",
                                                max_output_tokens=2)
    suffix = response.id.removeprefix("resp_")
    assert suffix != response.id and response.output[0].id == "msg_" + suffix
