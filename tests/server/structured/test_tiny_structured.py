"""Structured outputs end to end on the random tiny Llama (byte-level tokenizer) at TP1 and
TP2, driven by the official `openai` client: every seeded json_schema output parses and
validates (`jsonschema`, an oracle independent of xgrammar), choice and regex outputs match
(`re.fullmatch`), a `tool_choice: "required"` call validates against its tool's schema, and the
logprobs of constrained tokens are the raw full-vocabulary values (transformers' log_softmax
of the same checkpoint, within 1e-4), natural alternatives included: the grammar changes what
is sampled, never what is reported. Bad constraints are a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.oracles import check_natural
from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    hf_rows,
    launch,
    post,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
    write_model,
)

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 200
IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"structured_tp{request.param}")
    model = write_model(root / "model", "byte_level")
    server = launch(f"structured_tp{request.param}", model, request.param,
                    ["--capacity", "8", "--speculative-tokens", "3", "--ngram-min", "1"], root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def chat(server, **fields):
    return server.client().chat.completions.create(
        model=served_name(server), messages=MESSAGES, max_tokens=MAX_TOKENS, **fields)


def test_seeded_json_schema_outputs_all_validate(tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                  "strict": True}}
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda seed: chat(tiny, response_format=fmt, seed=seed,
                                               temperature=1.0), range(30)))
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({out.choices[0].message.content for out in outs}) > 1  # (really sampled)


def test_json_object_and_completions_response_format(tiny):
    out = chat(tiny, response_format={"type": "json_object"}, seed=3, temperature=1.0)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    done = tiny.client().completions.create(
        model=served_name(tiny), prompt="JSON:", max_tokens=MAX_TOKENS, seed=4,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_choice_and_regex_outputs_match(tiny):
    choices = ["alpha", "beta", 'say "hi"', "ünï"]
    pattern = r"(ab|cd)-[0-9]{2,5}x?"
    for seed in range(4):
        out = chat(tiny, seed=seed, temperature=1.0,
                   extra_body={"structured_outputs": {"choice": choices}})
        assert out.choices[0].message.content in choices
        out = chat(tiny, seed=seed, temperature=1.0,
                   extra_body={"structured_outputs": {"regex": pattern}})
        assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0]
        grammar = 'root ::= "x" digit+\ndigit ::= [0-9]'
        out = tiny.client().completions.create(
            model=served_name(tiny), prompt="n:", max_tokens=MAX_TOKENS, seed=seed,
            extra_body={"structured_outputs": {"grammar": grammar}})
        assert re.fullmatch(r"x[0-9]+", out.choices[0].text), out.choices[0]


def test_required_tool_call_validates(tiny):
    out = chat(tiny, tools=[WEATHER, CLOCK], tool_choice="required", seed=5, temperature=1.0)
    message = out.choices[0].message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    if message.tool_calls:  # (parsed into calls, as vLLM does)
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name])
    else:
        calls = json.loads(message.content)
        assert isinstance(calls, list) and calls
        for call in calls:
            jsonschema.validate(call["parameters"], schemas[call["name"]])
    named = chat(tiny, tools=[WEATHER, CLOCK], seed=6, temperature=1.0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = named.choices[0].message
    arguments = (message.tool_calls[0].function.arguments if message.tool_calls
                 else message.content)
    jsonschema.validate(json.loads(arguments), schemas["get_weather"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_logprobs_are_the_raw_values(tiny, temperature):
    """Each constrained token's entry and its natural top-5 equal transformers' unconstrained
    log_softmax row; the grammar forbade most of those alternatives (they are still reported,
    with their raw values), and streaming reports the same tokens and values."""
    # (compact JSON: with any whitespace allowed, the random model's greedy pick is a tab,
    # forever)
    constraint = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    fields = dict(logprobs=True, top_logprobs=5, seed=9, temperature=temperature,
                  extra_body={**IDS, **constraint})
    out = chat(tiny, **fields)
    content = out.choices[0].logprobs.content
    generated = [token_id_of(item.token) for item in content]
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    rows = hf_rows(tiny.model_dir, chat_prompt_ids(tiny.model_dir, MESSAGES), generated)
    forbidden = 0
    for j, item in enumerate(content):
        assert abs(item.logprob - float(rows[j, generated[j]])) <= TOLERANCE
        natural = [(token_id_of(alt.token), alt.logprob) for alt in item.top_logprobs]
        check_natural(natural, rows[j], 5)
        forbidden += generated[j] != int(rows[j].argmax())
    assert forbidden > 0  # (the mask changed the choice somewhere: the test can see it)
    body = {"model": served_name(tiny), "messages": MESSAGES, "max_tokens": MAX_TOKENS,
            "stream": True, **{k: v for k, v in fields.items() if k != "extra_body"}, **IDS,
            **constraint}
    events = sse_events(post(tiny, "/v1/chat/completions", body))
    streamed = [item for e in events if e["choices"] and e["choices"][0].get("logprobs")
                for item in e["choices"][0]["logprobs"]["content"]]
    assert [token_id_of(i["token"]) for i in streamed] == generated
    for item, entry in zip(streamed, content, strict=True):
        assert abs(item["logprob"] - entry.logprob) <= 1e-6


def test_responses_text_format(tiny):
    response = tiny.client().responses.create(
        model=served_name(tiny), input="Answer in JSON.", max_output_tokens=MAX_TOKENS,
        extra_body={"seed": 2},
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(("route", "fields", "param", "reason"), [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "integer", "minimum": 5, "maximum": 2}}}},
     "response_format.json_schema.schema", "minimum greater than maximum"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", "needs a schema"),
    ("chat", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
     "not closed"),
    ("completions", {"structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs.grammar", "not defined"),
    ("completions", {"structured_outputs": {"json": {"type": "foo"}}},
     "structured_outputs.json", "Unsupported type"),
    ("chat", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs",
     "one kind"),
])
def test_bad_constraints_are_400_naming_the_field(tiny, route, fields, param, reason):
    body = {"model": served_name(tiny), "max_tokens": 4, **fields}
    if route == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "x"
    for stream in (False, True):
        response = post(tiny, f"/v1/{route if route != 'chat' else 'chat/completions'}",
                        {**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = strict_json(response.content)["error"]
        assert error["param"] == param and reason in error["message"], error
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            chat(tiny, extra_body=fields)
        else:
            tiny.client().completions.create(model=served_name(tiny), prompt="x", max_tokens=4,
                                             extra_body=fields)
    assert raised.value.body["param"] == param


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f"helios:{name} "))


def test_speculative_rounds_under_a_grammar_equal_plain_decoding(tiny):
    """History proposals are masked from tentative matcher states and rolled back: a
    constrained request (greedy: the random model repeats whitespace, which proposals
    predict) emits the same tokens and logprobs with speculation on and off, and proposals
    were accepted while it ran."""
    accepted = metric(tiny, "spec_decode_num_accepted_tokens_total")
    body = {"model": served_name(tiny), "messages": MESSAGES, "max_tokens": 40,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 2, **IDS,
            "structured_outputs": {"json": SCHEMA}}
    off = strict_json(post(tiny, "/v1/chat/completions", {**body, "speculative": False})
                      .content)["choices"][0]
    on = strict_json(post(tiny, "/v1/chat/completions", body).content)["choices"][0]
    assert metric(tiny, "spec_decode_num_accepted_tokens_total") > accepted
    assert on["message"]["content"] == off["message"]["content"]
    assert len(on["logprobs"]["content"]) == 40
    for a, b in zip(on["logprobs"]["content"], off["logprobs"]["content"], strict=True):
        assert a["token"] == b["token"] and abs(a["logprob"] - b["logprob"]) <= 1e-5
