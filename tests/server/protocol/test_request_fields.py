"""The request-field policy: unknown fields are accepted and logged (as vLLM does); known
fields that would change the output but are not implemented are refused with 400 naming
them; known fields that cannot change the output are accepted silently."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import openai
import pytest

from helios_logprobs.runtime.http.protocol.refusals import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    IGNORED,
    REFUSED,
)
from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import Finished, GeneratedToken
from tests.server.helpers import served_name, strict_json
from tests.server.scripted_engine import ScriptedEngine

IGNORED_MESSAGE = "The following fields were present in the request but ignored"
COMPLETION = {"prompt": [5, 6], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ROUTES = {"completions": ("/v1/completions", COMPLETION),
          "chat": ("/v1/chat/completions", CHAT)}


def two_tokens() -> ScriptedEngine:
    """Two tokens then the end, for every request; counts admitted requests."""
    return ScriptedEngine([GeneratedToken(0, 70, None), GeneratedToken(1, 71, None),
                           Finished("length")])


@pytest.fixture(scope="module")
def app(model_dirs):
    engine = two_tokens()
    return engine, create_app(engine, model_dirs["byte_level"], "scripted")


def call(app, route: str, fields: dict, *, stream: bool = False) -> httpx.Response:
    path, base = ROUTES[route]
    body = {**base, **fields}
    if stream:
        body["stream"] = True

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app[1])
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def ignored_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "helios_logprobs.runtime.http" and IGNORED_MESSAGE in r.getMessage()]


# ----------------------------------------------------------------------------- unknown fields
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_accepted_and_logged_once(app, caplog, route, stream):
    fields = {"frobnicate": 3, "metadata": {"a": "b"}, "stream_options": {"shiny": True}}
    if not stream:
        del fields["stream_options"]
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.http"):
        response = call(app, route, fields, stream=stream)
    assert response.status_code == 200, response.text
    records = ignored_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "'frobnicate'" in message and "'metadata'" in message
    assert ("'stream_options.shiny'" in message) == stream


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_known_ignored_fields_are_accepted_silently(app, caplog, route):
    fields = {"user": "u1", "priority": 3, "request_id": "r-1", "cache_salt": "salt",
              "session_id": "s-9", "stream_interval": 4}
    if route == "chat":
        fields["parallel_tool_calls"] = False
    assert set(fields) <= set(IGNORED)
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.http"):
        response = call(app, route, fields)
    assert response.status_code == 200, response.text
    assert ignored_records(caplog) == []


def test_the_log_line_is_bounded(app, caplog):
    fields = {f"field_{i:03d}_" + "x" * 200: i for i in range(100)}
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.http"):
        assert call(app, "completions", fields).status_code == 200
    (record,) = ignored_records(caplog)
    assert "and 68 more" in record.getMessage() and len(record.getMessage()) < 4000


# ----------------------------------------------------------------------------- refused fields
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
REFUSED_VALUES = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "best_of": 3,
    "logits_processors": ["my.module:Proc"],
    "vllm_xargs": {"k": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "watermarking": True,
    "spaces_between_special_tokens": False,

    "kv_transfer_params": {"do_remote_decode": True},
    "guided_json": SCHEMA,
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "suffix": "tail",
    "prompt_embeds": "AAAA",
    "packed_top_logprobs": True,
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
    "chat_template": "{{ messages }}",
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"num_crops": 4},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
}
MORE_REFUSED = [
    ("completions", "response_format", {"type": "xml"}),
    ("completions", "structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("chat", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    # (a server without --enable-auto-tool-choice: tools' default "auto" cannot be honoured)
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "response_format", {"type": "structural_tag"}),
]
REFUSED_CASES = [
    *[("completions", name, REFUSED_VALUES[name]) for name in COMPLETION_REFUSED],
    *[("chat", name, REFUSED_VALUES[name]) for name in CHAT_REFUSED],
    *MORE_REFUSED,
]


def test_every_refused_field_has_a_case():
    assert set(REFUSED_VALUES) == set(REFUSED)
    assert set(COMPLETION_REFUSED) | set(CHAT_REFUSED) == set(REFUSED)


@pytest.mark.parametrize(("route", "name", "value"), REFUSED_CASES,
                         ids=lambda v: str(v)[:30])
def test_refused_fields_name_themselves(app, route, name, value):
    engine = app[0]
    before = engine.requests
    for stream in (False, True):
        response = call(app, route, {name: value}, stream=stream)
        assert response.status_code == 400, response.text
        body = strict_json(response.content)["error"]
        assert body == {"message": body["message"], "type": "BadRequestError", "param": name,
                        "code": 400}
        assert name in body["message"]
    assert engine.requests == before


DEFAULTS_ACCEPTED = [
    ("completions", {"use_beam_search": False, "length_penalty": 1.0, "best_of": 1,
                     "min_tokens": 0, "bad_words": [], "spaces_between_special_tokens": True,
                     "return_token_ids": False, "response_format": {"type": "text"},
                     "suffix": "", "logits_processors": [], "watermarking": False,
                     "packed_top_logprobs": False}),
    ("completions", {"n": 2, "best_of": 2, "response_format": None, "guided_json": None}),
    ("chat", {"tools": None, "tool_choice": "none", "include_reasoning": True,
              "response_format": {"type": "text"}, "modalities": ["text"],
              "parallel_tool_calls": True}),
    ("chat", {"tool_choice": None, "functions": [], "function_call": "none",
              "reasoning_effort": None, "chat_template": None}),
]


@pytest.mark.parametrize(("route", "fields"), DEFAULTS_ACCEPTED, ids=lambda v: str(v)[:30])
def test_default_values_of_refused_fields_are_accepted(app, caplog, route, fields):
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.http"):
        response = call(app, route, fields)
    assert response.status_code == 200, response.text
    assert ignored_records(caplog) == []


def test_other_endpoint_fields_are_unknown_there(app, caplog):
    """As in vLLM, a field of one endpoint sent to the other is an unknown field there."""
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.http"):
        assert call(app, "completions", {"tool_choice": "required"}).status_code == 200
        assert call(app, "chat", {"suffix": "tail"}).status_code == 200
    messages = [r.getMessage() for r in ignored_records(caplog)]
    assert len(messages) == 2
    assert "'tool_choice'" in messages[0] and "'suffix'" in messages[1]


def test_wrong_types_of_known_fields_are_refused(app):
    for route, fields, param in [("completions", {"min_tokens": "three"}, "min_tokens"),
                                 ("chat", {"priority": "high"}, "priority"),
                                 ("chat", {"include_reasoning": "maybe"}, "include_reasoning")]:
        response = call(app, route, fields)
        assert response.status_code == 400
        assert strict_json(response.content)["error"]["param"] == param


# ----------------------------------------------------------------------------- real server
@pytest.mark.slow
def test_real_server_logs_unknown_fields(server):
    probe = f"probe_{uuid.uuid4().hex[:12]}"
    client = server.client()
    out = client.completions.create(model=served_name(server), prompt="Hi", max_tokens=2,
                                    extra_body={probe: 1})
    assert out.choices[0].text is not None
    deadline = time.monotonic() + 10
    while probe not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_path.read_text(errors="replace")
    line = next(line for line in log.splitlines() if probe in line)
    assert IGNORED_MESSAGE in line and "helios_logprobs.runtime.http" in line
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served_name(server), max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "structural_tag"})
    assert info.value.status_code == 400 and info.value.body["param"] == "response_format"
