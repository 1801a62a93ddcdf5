"""Structured outputs on the real default model (SmolLM2-135M-Instruct, its Q4_1 GGUF: the
grammar's vocabulary is the GGUF tokenizer's, converted) at TP1, through the official `openai`
client (the masks on vocabulary shards are the tiny model's TP2 tests'): 30 seeded json_schema
answers all parse and validate (`jsonschema`), choice and regex answers match, and a `tool_choice:
"required"` call validates against its tool."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.server.generation.test_smollm2 import smollm2_file
from tests.server.helpers import launch, served_name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
MAX_TOKENS = 120
CLIENT_TIMEOUT_S = 1200.0


@pytest.fixture(scope="module", params=[1], ids=["tp1"])
def smollm2(request, tmp_path_factory):
    server = launch(f"smollm2_structured_tp{request.param}", smollm2_file(), request.param,
                    ["--capacity", "8"], tmp_path_factory.mktemp("smollm2_structured"))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def ask(server, question: str, **fields):
    # (a 135M model on CPU ranks shared with other tests: minutes for a batch, not seconds)
    client = server.client().with_options(timeout=CLIENT_TIMEOUT_S)
    return client.chat.completions.create(
        model=served_name(server), messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, **fields)


def test_seeded_json_schema_answers_all_validate(smollm2):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    def one(seed: int):
        return ask(smollm2, "Describe a person as JSON with a name, an age and a city.",
                   response_format=fmt, seed=seed, temperature=1.0)

    # (one batch of the server's 8 rows: 30 seeds cost the suite ten minutes under load)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for out in outs:
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert len({out.choices[0].message.content for out in outs}) > 1


def test_choice_and_regex_answers_match(smollm2):
    cities = ["Paris", "London", "Berlin", "Madrid"]
    for seed in range(3):
        out = ask(smollm2, "What is the capital of France?", seed=seed, temperature=1.0,
                  extra_body={"structured_outputs": {"choice": cities}})
        assert out.choices[0].message.content in cities
        out = ask(smollm2, "In which year did the Second World War end?", seed=seed,
                  temperature=1.0, extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
        assert re.fullmatch("[12][0-9]{3}", out.choices[0].message.content)


def test_required_tool_call_validates(smollm2):
    # (greedy: sampled, this small model may repeat the call until max_tokens; the
    # schema, vLLM's, has no upper bound on the number of calls)
    out = ask(smollm2, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
              temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "tool_calls"), out.choices[0]
    message = out.choices[0].message
    parameters = WEATHER["function"]["parameters"]
    if message.tool_calls:
        assert [c.function.name for c in message.tool_calls] == ["get_weather"] * len(
            message.tool_calls)
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters)
    else:
        calls = json.loads(message.content)
        assert calls and all(c["name"] == "get_weather" for c in calls)
        for call in calls:
            jsonschema.validate(call["parameters"], parameters)
