"""Chat `tools` / `tool_choice` / `parallel_tool_calls` (vLLM's rules and wording).

A server parses tool calls out of the output only when started with `--tool-call-parser`
and `--enable-auto-tool-choice` (vLLM's flags): then `tool_choice` "auto" (the default when
`tools` are given) parses the output with that parser. "none" passes the tools to the chat
template and parses nothing. "required" and a named function need the output constrained
to the call's JSON (vLLM: guided decoding with runtime.structured's `tool_call_constraint`);
the constraint goes on SamplingParams when the engine takes one, otherwise the request is
refused with 400 naming `tool_choice` (it could not be honoured).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from helios_logprobs.ranks.contract.requests import RequestError

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")


@dataclass(frozen=True)
class ToolServing:
    """The server's tool settings (its command line)."""

    parser: str | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        from helios_logprobs.runtime.text.parsers.tool_parsers import TOOL_PARSERS

        if self.parser is not None and self.parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.parser!r}")
        if self.auto and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools make of its output. `mode`: "none" (not parsed), "auto" (the
    server's parser), "required" (a JSON array of {name, parameters}) or "named" (the output
    is the arguments of `name`)."""

    mode: str = "none"
    parser: str | None = None
    name: str | None = None
    parallel: bool = True
    constraint: Any = None
    """The structured-output spec that forces the call ("required", "named")."""
    parameters: dict[str, Any] | None = None
    """Each tool's parameters schema by name ("auto": a parser may convert values by it)."""

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """Chat tools as given ({"type": "function", "function": {"name", ...}}), checked."""
    if not isinstance(tools, list):
        raise RequestError(param, f"{param} must be a list of tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or (
                not isinstance(function, dict)):
            raise RequestError(param, f"{param}[{i}]: expected {{\"type\": \"function\", "
                                      f"\"function\": {{\"name\": ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(param, f"{param}[{i}].function.name must be a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(param, f"{param}[{i}].function.parameters must be an object")
    return tools


def _named(choice: dict[str, Any]) -> str:
    inner = choice.get("function")
    name = inner.get("name") if isinstance(inner, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice", "a named tool_choice is {\"type\": \"function\", "
                                          "\"function\": {\"name\": ...}}")
    return name


def resolve_tool_use(tools: list[dict[str, Any]] | None, choice: Any,
                     parallel: bool | None, serving: ToolServing) -> ToolUse:
    """The request's ToolUse; RequestError (400) when it cannot be honoured."""
    parallel = True if parallel is None else parallel
    if not tools:
        return ToolUse(parallel=parallel)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolUse(parallel=parallel)
    if choice == "auto":
        if not (serving.auto and serving.parser):
            raise RequestError("tools", f"tools: {AUTO_NEEDS_FLAGS}")
        parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
        return ToolUse("auto", serving.parser, parallel=parallel, parameters=parameters)
    name = _named(choice) if isinstance(choice, dict) else None
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise RequestError("tool_choice", f"tool_choice: tool {name!r} has not been passed "
                                          "in `tools`")
    constraint = _constraint(tools, choice)
    mode = "required" if name is None else "named"
    return ToolUse(mode, name=name, parallel=parallel, constraint=constraint)


def _constraint(tools: list[dict[str, Any]], choice: Any) -> Any:
    try:
        from helios_logprobs.runtime.structured.spec import (
            StructuredSpecError,
            tool_call_constraint,
        )
    except ImportError:
        raise RequestError("tool_choice", f"tool_choice {json.dumps(choice)}: forcing a tool "
                                          "call needs structured outputs, which this server "
                                          "does not have") from None
    try:
        return tool_call_constraint(tools, choice)
    except StructuredSpecError as exc:
        raise RequestError(exc.field, str(exc)) from exc


CONSTRAINT_FIELDS = ("structured_outputs", "structured", "grammar")
"""SamplingParams field names a structured-output constraint may be given under."""


def constrained(params: Any, use: ToolUse) -> Any:
    """`params` with the forced call's constraint, or a 400 when the engine takes none."""
    if use.constraint is None:
        return params
    names = {f.name for f in dataclasses.fields(params)}
    for field in CONSTRAINT_FIELDS:
        if field in names:
            if getattr(params, field) is not None:
                raise RequestError("tool_choice", "tool_choice 'required' or a named function "
                                                  "cannot be combined with another "
                                                  "structured-output constraint")
            return dataclasses.replace(params, **{field: use.constraint})
    raise RequestError("tool_choice", f"tool_choice {use.mode!r}: forcing a tool call needs "
                                      "structured outputs, which this server's engine does "
                                      "not apply yet")
