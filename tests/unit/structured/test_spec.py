from __future__ import annotations

import jsonschema
import pytest

from helios_logprobs.runtime.structured.spec import (
    StructuredSpec,
    StructuredSpecError,
    tool_call_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def test_spec_rejects_unknown_kind_and_bad_values():
    with pytest.raises(ValueError, match="kind"):
        StructuredSpec("xml", "x")
    with pytest.raises(ValueError):
        StructuredSpec("choice", ())
    with pytest.raises(ValueError):
        StructuredSpec("regex", "")
    with pytest.raises(ValueError):
        StructuredSpec("json", "[1, 2]")
    with pytest.raises(ValueError):
        StructuredSpec("json_object", "{}")


def test_equal_schemas_give_equal_hashable_specs_in_the_clients_key_order():
    first = StructuredSpec.from_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    second = StructuredSpec.from_schema('{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert first == second and hash(first) == hash(second)
    assert list(first.schema()["properties"]) == ["b", "a"]  # (xgrammar emits this order)


def test_required_accepts_vllm_shaped_calls_and_rejects_others():
    spec = tool_call_constraint([WEATHER, CLOCK], "required")
    schema = spec.schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "other", "parameters": {}}],
        {"name": "get_time", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_hoists_defs():
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "required": ["p"],
                "$defs": {"P": {"type": "integer"}},
            },
        },
    }
    schema = tool_call_constraint([tool], "required").schema()
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "3"}}], schema)


def test_named_function_is_its_parameters_schema():
    chat_choice = {"type": "function", "function": {"name": "get_weather"}}
    responses_choice = {"type": "function", "name": "get_weather"}
    for choice in (chat_choice, responses_choice):
        spec = tool_call_constraint([WEATHER, CLOCK], choice)
        assert spec.schema() == WEATHER["function"]["parameters"]
    no_parameters = tool_call_constraint([CLOCK], {"type": "function", "name": "get_time"})
    assert no_parameters.schema() == {"type": "object", "properties": {}}


def test_unforced_and_unknown_choices():
    assert tool_call_constraint([WEATHER], "auto") is None
    assert tool_call_constraint([WEATHER], "none") is None
    assert tool_call_constraint(None, "required") is None
    with pytest.raises(StructuredSpecError) as raised:
        tool_call_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert raised.value.field == "tool_choice"
    with pytest.raises(StructuredSpecError):
        tool_call_constraint([WEATHER], "sometimes")
