"""Limits checked before any work: the body's size (while it is read), the JSON document's
nesting depth, and its strings (lone surrogates are not text). Each refusal names the field
where it can (the top-level key that holds the offending value)."""

from __future__ import annotations

import json
import re
from typing import Any

from helios_logprobs.ranks.contract.requests import RequestError

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
"""Containers nested deeper than this are refused (json and pydantic recurse)."""


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than this server's limit of {limit} bytes "
            f"(--max-request-bytes)"
        )


async def read_body(request: Any, limit: int) -> bytes:
    """The body, read as it streams in; BodyTooLarge as soon as it exceeds `limit` bytes (a
    Content-Length above the limit is refused before any of the body is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() \
            and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        if chunk:
            chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def _deep_field(raw: bytes, max_depth: int) -> str | None:
    """The top-level key whose value nests deeper than `max_depth` (error path only)."""
    depth, key = 0, None
    for match in _TOKENS.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return key
        elif token in (b"]", b"}"):
            depth -= 1
        elif depth == 1:
            try:
                key = json.loads(token)
            except ValueError:
                key = None
    return key


def _too_deep(field: str | None, max_depth: int) -> RequestError:
    where = f"{field}: " if field else ""
    return RequestError(field or "body",
                        f"{where}JSON nesting is deeper than {max_depth} levels")


def _not_text(field: str | None, value: str) -> RequestError:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        where = f"{field}: " if field else ""
        return RequestError(
            field or "body",
            f"{where}a string holds the lone surrogate \\u{ord(bad):04x}, which is not valid "
            f"Unicode text",
        )
    raise AssertionError("valid text")


def check_document(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Depth and strings of a decoded document, without recursion; RequestError names the
    top-level field."""
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise _not_text(field, value) from None
            continue
        if depth > max_depth:
            raise _too_deep(field, max_depth)
        if isinstance(value, dict):
            for key, inner in value.items():
                name = field if field is not None else key
                if not key.isascii():
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        raise _not_text(field or "body", key) from None
                if isinstance(inner, (dict, list)) or (
                        isinstance(inner, str) and not inner.isascii()):
                    stack.append((inner, depth + 1, name))
        else:
            for inner in value:
                if isinstance(inner, (dict, list)) or (
                        isinstance(inner, str) and not inner.isascii()):
                    stack.append((inner, depth + 1, field))


def decode_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as a checked JSON document; ValueError for malformed JSON, RequestError for
    one nested too deep or holding lone surrogates."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep(_deep_field(raw, max_depth), max_depth) from None
    if isinstance(data, (dict, list)):
        check_document(data, max_depth)
    return data
