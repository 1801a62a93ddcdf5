"""Response encoding: JSON (orjson), SSE events, error bodies.

orjson writes NaN and Infinity as null instead of refusing them; no body can hold one, because
the only floats in bodies are logprobs, and the wire builders (`wire.wire_logprob`) refuse NaN
and +inf and send -inf as -9999.0 before anything is encoded."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from fastapi.responses import Response

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.http.output.wire import NonFiniteLogprob
from helios_logprobs.runtime.http.protocol.models import error_body
from helios_logprobs.runtime.outputs import EngineError

log = logging.getLogger("helios_logprobs.runtime.http")


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. What orjson refuses (integers past 64 bits, keys that are not
    strings: a tokenizer_config.json passed through) goes through the standard encoder."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode()


PIECE = 65_536


def dumps_in_pieces(obj: dict[str, Any]) -> bytes:
    """`dumps(obj)` for a body with long top-level lists (/tokenize's `tokens`), encoded a
    slice at a time: the encoder holds the GIL for each call, and short calls let the event
    loop's thread run in between (run it off the loop)."""
    parts = []
    for key, value in obj.items():
        if isinstance(value, list) and len(value) > PIECE:
            items = b",".join(dumps(value[i:i + PIECE])[1:-1]
                              for i in range(0, len(value), PIECE))
            parts.append(dumps(key) + b":[" + items + b"]")
        else:
            parts.append(dumps(key) + b":" + dumps(value))
    return b"{" + b",".join(parts) + b"}"


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE lines for chunk objects; a failure after admission becomes an error event; [DONE]."""
    try:
        async with aclosing(chunks) as source:
            async for chunk in source:
                yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - reported to the client, then [DONE]
        log.warning("streamed request failed: %s", exc)
        yield sse(error_body(failure_message(exc), None, 500))
    yield SSE_DONE


async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The Responses API's framing (OpenAI's, and vLLM's _convert_stream_to_sse_events): an
    `event: <type>` line before each data line and no [DONE]; a failure after admission
    becomes an `error` event."""
    sequence = 0
    try:
        async with aclosing(chunks) as source:
            async for chunk in source:
                sequence = chunk["sequence_number"] + 1
                yield b"event: " + chunk["type"].encode() + b"\n" + sse(chunk)
    except Exception as exc:  # noqa: BLE001 - reported to the client
        log.warning("streamed request failed: %s", exc)
        error = {"type": "error", "code": None, "message": failure_message(exc), "param": None,
                 "sequence_number": sequence}
        yield b"event: error\n" + sse(error)


def failure_message(exc: BaseException) -> str:
    if isinstance(exc, NonFiniteLogprob):
        return f"request failed: {exc}"
    if isinstance(exc, EngineError):
        return str(exc) or "request failed in the engine"
    return f"request failed: {type(exc).__name__}: {exc}"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json",
                    headers=headers)


CLOSE = {"Connection": "close"}
"""After an internal error (500) the connection is not reused."""


def error_response(message: str, param: str | None, status: int = 400,
                   headers: dict[str, str] | None = None) -> Response:
    if status >= 500 and status != 503:
        headers = {**CLOSE, **(headers or {})}
    return json_response(error_body(message, param, status), status, headers)


def request_error_response(exc: RequestError) -> Response:
    message = exc.message if exc.param in exc.message else f"{exc.param}: {exc.message}"
    return error_response(message, exc.param)
