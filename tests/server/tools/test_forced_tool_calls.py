"""tool_choice "required" and a named function on the random tiny Llama (byte-level
tokenizer): runtime.structured constrains the output to vLLM's call JSON and the text side
parses it into tool calls (chat's tool_calls, the Responses API's function_call items), the
same streamed and whole. The oracle is `jsonschema` on the arguments and json.loads of the
raw output (return_token_ids, decoded independently)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.helpers import launch, served_name, write_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MESSAGES = [{"role": "user", "content": "Call a tool."}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("forced_tools")
    model = write_model(root / "model", "byte_level")
    server = launch("forced_tools", model, 1, ["--capacity", "4"], root)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def raw_text(server, token_ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def finished_outputs(server, tool_choice, seeds=range(12), wanted: int = 2):
    """(seed, choice) of the first `wanted` seeded outputs the constraint let finish before
    max_tokens."""
    out = []
    for seed in seeds:
        if len(out) == wanted:
            break
        response = server.client().chat.completions.create(
            model=served_name(server), messages=MESSAGES, tools=[WEATHER, CLOCK],
            tool_choice=tool_choice, seed=seed, temperature=1.0, max_tokens=200,
            extra_body={"return_token_ids": True})
        choice = response.choices[0]
        if choice.finish_reason != "length":
            out.append((seed, choice))
    assert out, "no seeded output finished within max_tokens"
    return out


def test_required_calls_are_parsed_from_the_constrained_json(tiny):
    for seed, choice in finished_outputs(tiny, "required"):
        raw = json.loads(raw_text(tiny, choice.model_extra["token_ids"]))
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (item["name"], item["parameters"]) for item in raw], seed
        for call in calls:
            assert call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed = list(tiny.client().chat.completions.create(
            model=served_name(tiny), messages=MESSAGES, tools=[WEATHER, CLOCK],
            tool_choice="required", seed=seed, temperature=1.0, max_tokens=200, stream=True))
        deltas = [c.choices[0] for c in streamed if c.choices]
        got = [(c.function.name, c.function.arguments) for d in deltas
               for c in d.delta.tool_calls or ()]
        assert got == [(c.function.name, c.function.arguments) for c in calls]
        assert deltas[-1].finish_reason == "tool_calls"


def test_named_function_output_is_its_arguments(tiny):
    for _, choice in finished_outputs(tiny, NAMED, seeds=range(6)):
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.message.content is None
        raw = raw_text(tiny, choice.model_extra["token_ids"])
        assert json.loads(call.function.arguments) == json.loads(raw)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert choice.finish_reason == "stop"  # (OpenAI's for a forced function)


def test_responses_required_call_is_a_function_call_item(tiny):
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    for seed in range(12):
        response = tiny.client().responses.create(
            model=served_name(tiny), input="Call a tool.", tools=tools,
            tool_choice="required", temperature=1.0, max_output_tokens=200,
            extra_body={"seed": seed})
        if response.status == "completed":
            break
    else:
        pytest.fail("no seeded output finished within max_output_tokens")
    assert response.tool_choice == "required"
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.type == "function_call" for item in response.output)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
