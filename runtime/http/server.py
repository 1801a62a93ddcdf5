"""The OpenAI-compatible HTTP server (FastAPI), and its uvicorn runner.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, and
vLLM's tokenizer routes POST /tokenize, POST /detokenize, GET /tokenizer_info.
Every refusal before admission is HTTP 400 with vLLM's error object naming the parameter;
bodies are encoded with allow_nan=False, so NaN or Infinity never reach a client.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ranks.requests import RequestError
from runtime.engine.client import EngineClient
from runtime.http.assets import ModelAssets
from runtime.http.chat import chat, prepare_chat, stream_chat
from runtime.http.completions import complete, prepare_completion, stream_completion
from runtime.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIModel,
    ignored_fields_message,
)
from runtime.http.responses import (
    error_response,
    failure_message,
    json_response,
    now,
    request_error_response,
    sse_stream,
)
from runtime.http.tokenization import detokenize_ids, tokenize, tokenize_model, tokenizer_info

log = logging.getLogger("runtime.http.server")
fields_log = logging.getLogger("runtime.http")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _validation_error(exc: ValidationError | RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid request")
    return error_response(f"{where}: {message}" if where else message, param)


async def parse_body(request: Request, model: type[BaseModel] | Callable[[dict], type[BaseModel]]
                     ) -> BaseModel | Response:
    """The body as `model` (or as the model `model(data)` picks for the decoded object)."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(f"invalid JSON body: {exc}", None)
    if not isinstance(data, dict):
        return error_response("the request body must be a JSON object", None)
    if not isinstance(model, type):
        model = model(data)
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        return _validation_error(exc)
    if isinstance(req, OpenAIModel) and (ignored := req.ignored_fields()):
        fields_log.warning(ignored_fields_message(ignored))
    return req


def capabilities(engine: EngineClient) -> dict[str, Any]:
    """What the core serves: K (natural alternatives; 0 = no logprobs), logprob_token_ids,
    and prompt scoring (prompt_logprobs, echo with logprobs: --prompt-logprobs)."""
    info = engine.info
    return {"max_logprobs": info.max_logprobs,
            "logprob_token_ids": info.supports_token_ids and info.allow_logprobs,
            "prompt_logprobs": info.prompt_logprobs}


def model_card(engine: EngineClient, assets: ModelAssets, created: int) -> dict[str, Any]:
    """vLLM's model card, with the permission entry that advertises allow_logprobs, and
    `capabilities` (this server's addition)."""
    name = assets.served_model_name
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "helios",
        "root": str(assets.model_dir),
        "parent": None,
        "max_model_len": engine.info.max_model_len,
        "permission": [{
            "id": f"modelperm-{name}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": engine.info.allow_logprobs,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
        "capabilities": capabilities(engine),
    }


def create_app(engine: EngineClient, model_dir: str | Path, served_model_name: str) -> FastAPI:
    assets = ModelAssets(model_dir, served_model_name, engine.info.vocab_size)
    app = FastAPI(title="helios", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.assets = assets
    created = now()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> Response:
        return request_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(str(exc.detail), None, exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(failure_message(exc), None, 500)

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy():
            return Response(status_code=200)
        return error_response("the engine is not healthy", None, 503)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(engine, assets, created)]})

    def precheck(req: Any) -> Response | None:
        if not assets.accepts_model(req.model):
            return error_response(f"The model `{req.model}` does not exist.", "model", 404)
        if not engine.healthy():
            return error_response("the engine is not healthy", None, 503)
        return None

    async def serve_request(request: Request, model: type[BaseModel], prepare, whole, chunks):
        req = await parse_body(request, model)
        if isinstance(req, Response):
            return req
        refused = precheck(req)
        if refused is not None:
            return refused
        try:
            prepared = prepare(req, engine, assets)
        except RequestError as exc:
            return request_error_response(exc)
        if req.stream:
            return StreamingResponse(
                sse_stream(chunks(prepared, engine, assets)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            return json_response(await whole(prepared, engine, assets))
        except RequestError as exc:
            return request_error_response(exc)
        except Exception as exc:  # noqa: BLE001 - failure after admission
            log.warning("request failed: %s", exc)
            return error_response(failure_message(exc), None, 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_request(
            request, CompletionRequest, prepare_completion, complete, stream_completion
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_request(
            request, ChatCompletionRequest, prepare_chat, chat, stream_chat
        )

    async def serve_tokenizer(request: Request, model, answer) -> Response:
        req = await parse_body(request, model)
        if isinstance(req, Response):
            return req
        if not assets.accepts_model(req.model):
            return error_response(f"The model `{req.model}` does not exist.", "model", 404)
        try:
            return json_response(answer(req))
        except RequestError as exc:
            return request_error_response(exc)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await serve_tokenizer(
            request, tokenize_model, lambda req: tokenize(req, assets, engine.info.max_model_len)
        )

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await serve_tokenizer(
            request, DetokenizeRequest,
            lambda req: detokenize_ids(req, assets, engine.info.vocab_size),
        )

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return json_response(tokenizer_info(assets))

    return app


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Run uvicorn in this (main) thread until SIGINT/SIGTERM."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    uvicorn.Server(config).run()
