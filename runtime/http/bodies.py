"""Reading a request: its body within the size limit, decoded and validated in a worker thread
(megabytes of JSON never block the event loop), unknown fields logged once; and waiting for a
client to go away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.http.protocol.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyTooLarge,
    decode_json,
    read_body,
)
from helios_logprobs.runtime.http.protocol.models import (
    OpenAIModel,
)
from helios_logprobs.runtime.http.protocol.refusals import ignored_fields_message
from helios_logprobs.runtime.http.responses import (
    error_response,
    request_error_response,
)

fields_log = logging.getLogger("helios_logprobs.runtime.http")
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"
T = TypeVar("T")


def validation_error(exc: ValidationError | RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {}
    # A union (prompt: text, ids or lists of either) fails once per member: the deepest
    # failure is the one that says what was wrong (e.g. `false` where a token id goes).
    same = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    first = max(same, key=lambda e: len(e.get("loc", ())), default=first)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid request")
    if kind := first.get("type"):
        # pydantic's own suffix: vLLM's message carries the error type too (clients match
        # e.g. "less_than_equal" for an out-of-range seed).
        message = f"{message} [type={kind}]"
    return error_response(f"{where}: {message}" if where else message, param)


def _decode(raw: bytes, model: type[BaseModel] | Callable[[dict], type[BaseModel]]
            ) -> BaseModel | Response:
    """Parse and validate (in a worker thread: megabytes of JSON take a while)."""
    try:
        data = decode_json(raw)
    except RequestError as exc:
        return request_error_response(exc)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(f"invalid JSON body: {exc}", None)
    if not isinstance(data, dict):
        return error_response("the request body must be a JSON object", None)
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        return validation_error(exc)


async def parse_body(request: Request, model: type[BaseModel] | Callable[[dict], type[BaseModel]],
                     max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> BaseModel | Response:
    """The body as `model` (or as the model `model(data)` picks for the decoded object); an
    error response for a body over `max_bytes` (413), malformed, too deeply nested, holding
    lone surrogates or failing validation (400), and for a body not sent as JSON (400)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        # vLLM's validate_json_request (every JSON endpoint; its 400 since it stopped using 415)
        return error_response(UNSUPPORTED_MEDIA_TYPE, None)
    try:
        raw = await read_body(request, max_bytes)
    except BodyTooLarge as exc:
        return error_response(str(exc), None, 413)
    req = await off_loop(_decode, raw, model)
    if isinstance(req, OpenAIModel) and (ignored := req.ignored_fields()):
        fields_log.warning(ignored_fields_message(ignored))
    return req


PREP_THREADS = 4
_prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="http-prepare")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the preparation pool: parsing, tokenization, template rendering and
    detokenization never block the event loop (/health and streams keep being served)."""
    return await asyncio.get_running_loop().run_in_executor(_prep_pool, fn, *args)


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
