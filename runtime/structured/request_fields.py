"""Request fields -> one StructuredSpec, checked (every refusal a RequestError naming the
field: HTTP 400 before admission).

* ``response_format`` (chat and completions, as vLLM takes it): ``{"type": "text"}``,
  ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``. ``strict`` is accepted either way: xgrammar always enforces
  the whole schema.
* ``structured_outputs`` (vLLM's StructuredOutputsParams): exactly one of ``json`` (a schema,
  object or JSON text), ``regex``, ``choice``, ``grammar`` (EBNF), ``json_object``; with
  ``disable_any_whitespace``. Its other options (structural tags, whitespace patterns,
  additional-properties switches) are refused.
* Responses ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "name", "schema", "strict", "description"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.structured.grammar import check_spec
from helios_logprobs.runtime.structured.spec import StructuredSpec

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)
REFUSED_OPTIONS = ("disable_additional_properties", "whitespace_pattern", "structural_tag",
                   "disable_fallback")
MAX_CHOICES = 4096


def _schema(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError(field, f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(value, dict | bool):
        raise RequestError(field, "a JSON schema must be an object")
    return value


def _top(field: str) -> str:
    return field.split(".", 1)[0]


def _schema_spec(schema: Any, field: str, any_whitespace: bool = True) -> StructuredSpec:
    spec = StructuredSpec.from_schema(_schema(schema, field), any_whitespace, _top(field))
    check_spec(spec, field)
    return spec


def _json_schema_format(body: Mapping[str, Any], field: str) -> StructuredSpec:
    """A json_schema format's body: {"name", "schema", "strict", "description"}."""
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{field}.name", "must be a string")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{field}.strict", "must be a boolean")
    if body.get("schema") is None:
        raise RequestError(f"{field}.schema", "a json_schema format needs a schema")
    return _schema_spec(body["schema"], f"{field}.schema")


def response_format_spec(value: Any, field: str = "response_format") -> StructuredSpec | None:
    """The constraint of a chat or completions ``response_format`` (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(field, "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        spec = StructuredSpec("json_object", source=_top(field))
        check_spec(spec, field)
        return spec
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, Mapping):
            raise RequestError(f"{field}.json_schema",
                               "a json_schema response_format needs a json_schema object")
        return _json_schema_format(body, f"{field}.json_schema")
    if kind == "structural_tag":
        raise RequestError(field, "structural_tag response formats are not supported")
    raise RequestError(field, f"type must be 'text', 'json_object' or 'json_schema', got "
                              f"{kind!r}")


def text_format_spec(text: Any, field: str = "text") -> StructuredSpec | None:
    """The constraint of a Responses request's ``text.format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise RequestError(field, "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    where = f"{field}.format"
    if not isinstance(fmt, Mapping):
        raise RequestError(where, "must be an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", source=_top(field))
    if kind == "json_schema":
        return _json_schema_format(fmt, where)
    raise RequestError(where, f"type must be 'text', 'json_object' or 'json_schema', got "
                              f"{kind!r}")


def structured_outputs_spec(value: Any, field: str = "structured_outputs"
                            ) -> StructuredSpec | None:
    """The constraint of vLLM's ``structured_outputs`` object (None: no constraint)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(field, "must be an object")
    unknown = sorted(set(value) - set(CONSTRAINTS) - set(OPTIONS) - set(REFUSED_OPTIONS))
    if unknown:
        raise RequestError(f"{field}.{unknown[0]}", "unknown structured_outputs option")
    for name in REFUSED_OPTIONS:
        if value.get(name) not in (None, False):
            raise RequestError(f"{field}.{name}", "not supported by this server")
    given = [name for name in CONSTRAINTS if value.get(name) not in (None, False)]
    if len(given) > 1:
        raise RequestError(field, "You can only use one kind of constraints for structured "
                                  f"outputs ('json', 'regex', 'choice', 'grammar' or "
                                  f"'json_object'), got {given}")
    if not given:
        return None
    disable = value.get("disable_any_whitespace", False)
    if not isinstance(disable, bool):
        raise RequestError(f"{field}.disable_any_whitespace", "must be a boolean")
    name = given[0]
    where = f"{field}.{name}"
    raw = value[name]
    if name == "json":
        return _schema_spec(raw, where, not disable)
    if name == "json_object":
        if raw is not True:
            raise RequestError(where, "must be true or absent")
        spec = StructuredSpec("json_object", any_whitespace=not disable, source=_top(field))
    elif name == "choice":
        if (not isinstance(raw, list) or not raw or len(raw) > MAX_CHOICES
                or not all(isinstance(choice, str) for choice in raw)):
            raise RequestError(where, f"must be a list of 1 to {MAX_CHOICES} strings")
        spec = StructuredSpec.from_choices(raw, source=_top(field))
    else:
        if not isinstance(raw, str) or not raw:
            raise RequestError(where, "must be a non-empty string")
        spec = StructuredSpec(name, raw, source=_top(field))
    check_spec(spec, where)
    return spec


def request_spec(response_format: Any, structured_outputs: Any,
                 forced: StructuredSpec | None = None) -> StructuredSpec | None:
    """The one constraint of a request: its response_format, its structured_outputs, or
    ``forced`` (what tool_choice requires); two of them at once are refused."""
    if forced is not None:
        check_spec(forced, forced.source)
    found = [(name, spec) for name, spec in (
        ("response_format", response_format_spec(response_format)),
        ("structured_outputs", structured_outputs_spec(structured_outputs)),
        ("tool_choice", forced),
    ) if spec is not None]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise RequestError(found[-1][0], f"only one output constraint per request: {names} "
                                         f"both constrain the output")
    return found[0][1] if found else None


def chat_response_format(text: Any) -> dict[str, Any] | None:
    """A Responses ``text`` object's format as chat's ``response_format`` (None: plain text);
    call ``text_format_spec`` first, which refuses what this cannot convert."""
    fmt = (text or {}).get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    body = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
    return {"type": "json_schema", "json_schema": body}
