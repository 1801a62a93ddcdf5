"""The request-side structured-output spec and the constraint a forced tool call implies.

`StructuredSpec` is what the HTTP layer hands the engine: one kind and its value, checked
here so that a malformed spec never reaches the grammar compiler. `tool_call_constraint`
mirrors vLLM's `_get_json_schema_from_tool` (chat protocol) so that `tool_choice: required`
and a named function constrain the output to the same JSON vLLM would accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.collectives.codec import message

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# vLLM's default for a tool without `parameters`.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class StructuredSpecError(ValueError):
    """A structured-output request that cannot be constrained; `field` names the input."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@message("structured_spec")
@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint.

    kind "json": value is the JSON schema, as canonical JSON text (so the spec is hashable
    and is the grammar cache's key); "json_object": any JSON object, value ""; "regex": the
    pattern; "choice": a tuple of the allowed strings; "grammar": EBNF (GBNF) text.
    ``any_whitespace`` (json kinds): any whitespace between JSON tokens, vLLM's default
    (structured_outputs.disable_any_whitespace turns it off: compact JSON).
    """

    kind: str
    value: str | tuple[str, ...] = ""
    any_whitespace: bool = True
    source: str = field(default="structured_outputs", compare=False)
    """The request field the constraint came from (named by a refusal); not part of the
    spec's identity, so the same schema from two fields shares one compiled grammar."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("source must name the request field")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError("any_whitespace must be a boolean")
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise ValueError("a choice spec needs a non-empty tuple of strings")
            if not all(isinstance(option, str) for option in self.value):
                raise ValueError("every choice must be a string")
            return
        if not isinstance(self.value, str):
            raise ValueError(f"a {self.kind} spec needs a string value")
        if self.kind == "json_object":
            if self.value:
                raise ValueError("a json_object spec has no value")
        elif not self.value:
            raise ValueError(f"a {self.kind} spec needs a non-empty value")
        if self.kind == "json":
            schema = json.loads(self.value)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")

    @classmethod
    def from_schema(cls, schema: Any, any_whitespace: bool = True,
                    source: str = "structured_outputs") -> StructuredSpec:
        """A "json" spec from a schema given as a dict (or JSON text)."""
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls("json", canonical_json(schema), any_whitespace, source)

    @classmethod
    def from_choices(cls, choices: Sequence[str], source: str = "structured_outputs"
                     ) -> StructuredSpec:
        return cls("choice", tuple(choices), source=source)

    def schema(self) -> Any:
        """The JSON schema of a "json" spec, as a Python object."""
        if self.kind != "json":
            raise ValueError(f"a {self.kind} spec has no schema")
        return json.loads(self.value)


def canonical_json(value: Any) -> str:
    """Compact JSON text, keys in the client's order: xgrammar emits an object's properties in
    schema order, so sorting them would change the output. Equal texts share a cache entry."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function object of an OpenAI chat tool ({"type": "function", "function": {...}});
    a Responses-style flat tool ({"type": "function", "name": ..., "parameters": ...}) too."""
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise StructuredSpecError("tools", "every tool needs a function with a string name")
    return function


def _parameters_of(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if parameters is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise StructuredSpecError("tools", f"{function['name']}: parameters must be an object")
    return json.loads(json.dumps(parameters))  # a deep copy we may edit ($defs hoisting)


def _named_function(tool_choice: Any) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": X}} in
    chat, {"type": "function", "name": X} in Responses), or None for the string modes."""
    if isinstance(tool_choice, Mapping):
        inner = tool_choice.get("function", tool_choice)
        name = inner.get("name") if isinstance(inner, Mapping) else None
        if not isinstance(name, str):
            raise StructuredSpecError("tool_choice", "a named tool_choice needs a function name")
        return name
    return None


def required_tools_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: "required"`: a non-empty array of {name, parameters}
    objects, one anyOf branch per tool, the tools' `$defs` hoisted to the top level."""
    branches = []
    all_defs: dict[str, Any] = {}
    for tool in tools:
        function = _function_of(tool)
        parameters = _parameters_of(function)
        for def_name, def_schema in parameters.pop("$defs", {}).items():
            if def_name in all_defs and all_defs[def_name] != def_schema:
                raise StructuredSpecError(
                    "tools", f"tool definition {def_name!r} has multiple schemas"
                )
            all_defs[def_name] = def_schema
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any
) -> StructuredSpec | None:
    """The spec a tool_choice forces, or None when it forces nothing ("auto", "none", no
    tools). "required": `required_tools_schema(tools)`; a named function: its parameters'
    schema (the output is the arguments object alone, as in vLLM)."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    name = _named_function(tool_choice)
    if name is not None:
        for tool in tools:
            function = _function_of(tool)
            if function["name"] == name:
                return StructuredSpec.from_schema(_parameters_of(function), source="tools")
        raise StructuredSpecError("tool_choice", f"tool {name!r} has not been passed in tools")
    if tool_choice == "required":
        return StructuredSpec.from_schema(required_tools_schema(tools), source="tools")
    raise StructuredSpecError(
        "tool_choice", f"must be 'auto', 'none', 'required' or a named function: {tool_choice!r}"
    )
