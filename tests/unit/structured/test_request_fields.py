"""Request fields -> StructuredSpec: what vLLM takes (response_format, structured_outputs,
Responses text.format), and a RequestError naming the field, with xgrammar's reason, for
anything that cannot be constrained."""

from __future__ import annotations

import numpy as np
import pytest

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.structured.request_fields import (
    request_spec,
    response_format_spec,
    structured_outputs_spec,
    text_format_spec,
)
from helios_logprobs.runtime.structured.spec import StructuredSpec, tool_call_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def refused(call, *args) -> RequestError:
    with pytest.raises(RequestError) as raised:
        call(*args)
    return raised.value


def test_response_format_kinds():
    assert response_format_spec(None) is None
    assert response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}) == StructuredSpec("json_object")
    spec = response_format_spec({"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json" and spec.schema() == SCHEMA and spec.source == "response_format"


@pytest.mark.parametrize("value, param", [
    ({"type": "xml"}, "response_format"),
    ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": "{not json"}},
     "response_format.json_schema.schema"),
])
def test_response_format_refusals_name_the_field(value, param):
    assert refused(response_format_spec, value).param == param


def test_an_uncompilable_schema_is_refused_with_xgrammars_reason():
    schema = {"type": "integer", "minimum": 5, "maximum": 2}
    error = refused(structured_outputs_spec, {"json": schema})
    assert error.param == "structured_outputs.json"
    assert "minimum greater than maximum" in error.message
    assert "/project/" not in error.message  # (xgrammar's log prefix is stripped)


def test_structured_outputs_kinds():
    assert structured_outputs_spec({"regex": "[a-z]+"}) == StructuredSpec("regex", "[a-z]+")
    assert structured_outputs_spec({"choice": ["x", "y"]}) == StructuredSpec("choice",
                                                                             ("x", "y"))
    assert structured_outputs_spec({"grammar": 'root ::= "a"'}).kind == "grammar"
    assert structured_outputs_spec({"json_object": True}).kind == "json_object"
    compact = structured_outputs_spec({"json": SCHEMA, "disable_any_whitespace": True})
    assert compact.kind == "json" and compact.any_whitespace is False
    assert structured_outputs_spec({"json": '{"type": "string"}'}).schema() == {"type": "string"}


@pytest.mark.parametrize("value, param", [
    ({"regex": "(ab"}, "structured_outputs.regex"),
    ({"regex": "a(?=b)"}, "structured_outputs.regex"),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ({"regexp": "a"}, "structured_outputs.regexp"),
    ([1], "structured_outputs"),
])
def test_structured_outputs_refusals_name_the_field(value, param):
    assert refused(structured_outputs_spec, value).param == param


def test_responses_text_format():
    assert text_format_spec({"format": {"type": "text"}}) is None
    spec = text_format_spec({"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}})
    assert spec.schema() == SCHEMA and spec.source == "text"
    assert refused(text_format_spec, {"format": {"type": "json_schema"}}).param == \
        "text.format.schema"


def test_one_constraint_per_request():
    forced = tool_call_constraint([{"type": "function", "function": {"name": "f"}}], "required")
    assert request_spec(None, None, forced) == forced
    error = refused(request_spec, {"type": "json_object"}, {"regex": "a"})
    assert error.param == "structured_outputs"
    assert refused(request_spec, {"type": "json_object"}, None, forced).param == "tool_choice"


def test_sampling_params_check_the_spec_and_refuse_a_thinking_budget():
    from helios_logprobs.collectives.codec import decode, encode
    from helios_logprobs.runtime.engine.client import SamplingParams
    from helios_logprobs.runtime.frontend.messages import Submit

    spec = structured_outputs_spec({"choice": ["a", "b"]})
    params = SamplingParams(max_tokens=4, structured=spec)
    submit = Submit(0, 1, np.array([1, 2]), params)
    assert decode(encode(submit)).params == params  # (the API server -> engine core message)
    with pytest.raises(RequestError) as raised:
        SamplingParams(max_tokens=4, structured=spec, thinking_token_budget=8)
    assert raised.value.param == "thinking_token_budget"
    forced = StructuredSpec("regex", "(ab", source="tools")
    with pytest.raises(RequestError) as raised:
        SamplingParams(max_tokens=4, structured=forced)
    assert raised.value.param == "tools" and "not closed" in raised.value.message
