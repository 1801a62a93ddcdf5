"""A StructuredSpec -> an xgrammar Grammar, as vLLM's xgrammar backend builds it
(vllm/v1/structured_output/backend_xgrammar.py): a JSON schema through xgrammar's JSON-schema
converter, json_object as the schema {"type": "object"}, a regex through its regex converter,
a grammar as EBNF (GBNF), and a choice as the grammar ``root ::= "a" | "b"`` (vLLM's
``choice_as_grammar``).

Building a Grammar needs no tokenizer, so the API server checks every spec here before
admission (``check_spec``: a RequestError naming the field, with xgrammar's reason); the
engine core compiles the same Grammar against the served vocabulary (backend.py).
"""

from __future__ import annotations

import re
from functools import lru_cache

import xgrammar as xgr

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.structured.spec import StructuredSpec

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: (Check failed: )?")
"""xgrammar's C++ errors start with a time stamp and a source location: not for clients."""


def choice_as_grammar(choices: tuple[str, ...]) -> str:
    """vLLM's choice_as_grammar: each choice a quoted EBNF string (backslash and quote
    escaped), joined as alternatives of the root rule."""
    escaped = (re.sub(r'(["\\])', r"\\\1", choice) for choice in choices)
    return "root ::= " + " | ".join(f'"{choice}"' for choice in escaped)


def grammar_reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = " ".join(str(exc).split())
    return _LOG_PREFIX.sub("", text) or type(exc).__name__


@lru_cache(maxsize=256)
def grammar_of(spec: StructuredSpec) -> xgr.Grammar:
    """The spec's Grammar (cached per spec: equal schemas share one). Raises ValueError with
    xgrammar's reason when it cannot build one."""
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA,
                                                any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_as_grammar(spec.value))
        return xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(grammar_reason(exc)) from exc


def check_spec(spec: StructuredSpec, field: str) -> None:
    """RequestError(field) when xgrammar cannot build the spec's grammar (an invalid or
    unsupported schema, regex or grammar): a 400 before admission."""
    try:
        grammar_of(spec)
    except ValueError as exc:
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[spec.kind]
        raise RequestError(field, f"invalid {what}: {exc}") from exc
