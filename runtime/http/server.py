"""The OpenAI-compatible HTTP server (FastAPI), and its uvicorn runner.

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions,
POST /v1/responses, and
vLLM's tokenizer routes POST /tokenize, POST /detokenize, GET /tokenizer_info; vLLM's
token-in/token-out POST /inference/v1/generate and its weight-sync routes (endpoints/weights.py).
Every refusal before admission is HTTP 400 with vLLM's error object naming the parameter;
NaN or Infinity never reach a client (see runtime/http/responses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.client import EngineClient
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.bodies import (
    off_loop,
    parse_body,
    until_disconnected,
    validation_error,
)
from helios_logprobs.runtime.http.endpoints.chat import chat, prepare_chat, stream_chat
from helios_logprobs.runtime.http.endpoints.completions import (
    complete,
    prepare_completion,
    stream_completion,
)
from helios_logprobs.runtime.http.endpoints.generate import (
    GenerateRequest,
    generate_whole,
    prepare_generate,
    stream_generate,
)
from helios_logprobs.runtime.http.endpoints.responses_api import (
    prepare_responses,
    respond,
    stream_responses,
)
from helios_logprobs.runtime.http.endpoints.tokenization import (
    detokenize_ids,
    tokenize,
    tokenize_model,
    tokenizer_info,
)
from helios_logprobs.runtime.http.endpoints.weights import add_weight_routes
from helios_logprobs.runtime.http.metrics import (
    RETRY_AFTER_S,
    Admission,
    Metrics,
    Observed,
    ServerStats,
    default_queue_limit,
)
from helios_logprobs.runtime.http.openapi import openapi_document
from helios_logprobs.runtime.http.protocol.defaults import FROM_MODEL
from helios_logprobs.runtime.http.protocol.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
)
from helios_logprobs.runtime.http.protocol.models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
)
from helios_logprobs.runtime.http.responses import (
    dumps,
    dumps_in_pieces,
    error_response,
    failure_message,
    json_response,
    now,
    request_error_response,
    sse_events,
    sse_stream,
)

log = logging.getLogger("helios_logprobs.runtime.http.server")
request_log = logging.getLogger("helios_logprobs.requests")
"""--enable-log-requests: one INFO line per admitted request."""
try:
    VERSION = importlib.metadata.version("helios-logprobs")
except importlib.metadata.PackageNotFoundError:  # (run from a checkout without installing)
    VERSION = "unknown"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def capabilities(engine: EngineClient) -> dict[str, Any]:
    """What the core serves: K (natural alternatives; 0 = no logprobs), logprob_token_ids,
    and prompt scoring (prompt_logprobs, echo with logprobs: --prompt-logprobs)."""
    info = engine.info
    return {"max_logprobs": info.max_logprobs,
            "logprob_token_ids": info.supports_token_ids and info.allow_logprobs,
            "prompt_logprobs": info.prompt_logprobs}


def model_card(engine: EngineClient, assets: ModelAssets, created: int,
               name: str | None = None) -> dict[str, Any]:
    """vLLM's model card (of ``name``, one of the served names; default: the first), with the
    permission entry that advertises allow_logprobs, and `capabilities` (this server's
    addition)."""
    name = name or assets.served_model_name
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


def create_app(engine: EngineClient, model_dir: str | Path,
               served_model_name: str | Sequence[str], *,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_queued_requests: int | None = None,
               generation_config: str = FROM_MODEL,
               log_requests: bool = False) -> FastAPI:
    """The app. `served_model_name`: the names requests may give as `model` (responses carry
    the first). `max_queued_requests` bounds waiting + running engine requests (None: four
    per slot of an engine with a scheduler, else unbounded); beyond it, 429.
    `generation_config`: where unset sampling fields take their defaults (defaults.py).
    `log_requests`: log each admitted request at INFO (vLLM's --enable-log-requests)."""
    if log_requests:
        request_log.setLevel(logging.INFO)
    assets = ModelAssets(model_dir, served_model_name, engine.info.vocab_size,
                         generation_config)
    if assets.sampling_defaults.overrides():
        log.warning("sampling defaults from %s: %s (--generation-config vllm for neutral ones)",
                    assets.sampling_defaults.source, assets.sampling_defaults.overrides())
    app = FastAPI(title="helios", docs_url=None, redoc_url=None)
    info = engine.info
    app.openapi = lambda: openapi_document(  # GET /openapi.json
        app, VERSION, vocab=min(info.vocab_size, assets.token_bytes.size), k=info.max_logprobs,
        max_model_len=info.max_model_len, scoring=info.prompt_logprobs)
    if max_queued_requests is None:
        capacity = getattr(getattr(engine, "config", None), "capacity", None)
        max_queued_requests = default_queue_limit(capacity) if capacity else None
    admission = Admission(engine, max_queued_requests)
    stats = ServerStats()
    metrics = Metrics(engine, admission, stats)
    app.state.engine = engine
    observed = Observed(engine, stats)
    app.state.assets = assets
    app.state.admission = admission
    app.state.stats = stats
    created = now()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> Response:
        return request_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # (its headers too: a 405 names the allowed methods in Allow, as RFC 9110 asks)
        return error_response(str(exc.detail), None, exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(failure_message(exc), None, 500)

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy():
            return Response(status_code=200)
        return error_response("the engine is not healthy", None, 503)

    # vLLM's (SageMaker's) liveness route, GET and POST: /health's answer.
    app.add_api_route("/ping", health, methods=["GET", "POST"], name="ping")

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": VERSION})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [model_card(engine, assets, created, name) for name in assets.served_model_names]
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in assets.served_model_names:
            return error_response(f"The model `{model_id}` does not exist.", "model", 404)
        return json_response(model_card(engine, assets, created, model_id))

    def precheck(req: Any) -> Response | None:
        if not assets.accepts_model(req.model):
            return error_response(f"The model `{req.model}` does not exist.", "model", 404)
        if not engine.healthy():
            return error_response("the engine is not healthy", None, 503)
        return None

    def overloaded() -> Response:
        stats.reject("queue_full")
        return error_response(
            f"the server is at its limit of {admission.limit} queued requests (waiting + "
            f"running, --max-queued-requests); retry after {RETRY_AFTER_S} s",
            None, 429, {"Retry-After": str(RETRY_AFTER_S)},
        )

    def admitted(prepared: Any) -> None:
        stats.prompt_tokens.inc(prepared.totals.prompt_tokens)
        stats.admitted.inc(len(prepared.jobs))
        req = prepared.request
        if prepared.mode is not None or req.prompt_logprobs is not None:
            stats.logprob_requests.inc()

    def ended(prepared: Any, reasons: list[str | None]) -> None:
        admission.release(len(prepared.jobs))
        stats.admitted.dec(len(prepared.jobs))
        stats.generation_tokens.inc(prepared.totals.completion_tokens)
        for reason in reasons:
            stats.finish(reason)

    def streamed(prepared: Any, chunks: AsyncIterator[dict[str, Any]], framing) -> Response:
        reasons: dict[int, str] = {}

        async def observed() -> AsyncIterator[dict[str, Any]]:
            try:
                async for chunk in chunks:
                    for choice in chunk.get("choices", ()):
                        if choice.get("finish_reason") is not None:
                            reasons[choice["index"]] = choice["finish_reason"]
                    if chunk.get("type") in ("response.completed", "response.incomplete"):
                        reasons[0] = finish_reasons(chunk["response"])[0]
                    yield chunk
            except Exception:
                reasons.update({j.index: "error" for j in prepared.jobs
                                if j.index not in reasons})
                raise

        def close() -> None:
            ended(prepared, [reasons.get(job.index) for job in prepared.jobs])

        return TrackedStream(framing(observed()), close, media_type="text/event-stream",
                             headers=SSE_HEADERS)

    handlers = {  # request model -> (prepare, whole response, stream chunks, framing)
        CompletionRequest: (prepare_completion, complete, stream_completion, sse_stream),
        ChatCompletionRequest: (prepare_chat, chat, stream_chat, sse_stream),
        ResponsesRequest: (prepare_responses, respond, stream_responses, sse_events),
        GenerateRequest: (prepare_generate, generate_whole, stream_generate, sse_stream),
    }

    async def serve_request(request: Request, model) -> Response:
        req = await parse_body(request, model, max_request_bytes)
        if isinstance(req, Response):
            if req.status_code == 413:
                stats.reject("too_large")
            return req
        prepare, whole, chunks, framing = handlers[type(req)]
        refused = precheck(req)
        if refused is not None:
            return refused
        try:
            prepared = await off_loop(prepare, req, engine, assets)
        except RequestError as exc:
            return request_error_response(exc)
        if not admission.try_admit(len(prepared.jobs)):
            return overloaded()
        admitted(prepared)
        if log_requests:
            log_request(request.url.path, prepared)
        if req.stream:
            return streamed(prepared, chunks(prepared, observed, assets), framing)
        reasons: list[str | None] = [None] * len(prepared.jobs)
        try:
            work = asyncio.ensure_future(whole(prepared, observed, assets))
            gone = asyncio.ensure_future(until_disconnected(request))
            try:
                await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not work.done():
                    work.cancel()  # the engine requests are aborted (run_choice's aclosing)
                await asyncio.gather(work, gone, return_exceptions=True)
            if work.cancelled():
                return error_response("the client disconnected", None, 499)
            body = work.result()
            reasons = finish_reasons(body)
            text = await off_loop(dumps, body)
            return Response(text, media_type="application/json")
        except RequestError as exc:
            reasons = ["error"] * len(prepared.jobs)
            return request_error_response(exc)
        except Exception as exc:  # noqa: BLE001 - failure after admission
            reasons = ["error"] * len(prepared.jobs)
            log.warning("request failed: %s", exc)
            return error_response(failure_message(exc), None, 500)
        finally:
            ended(prepared, reasons)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_request(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_request(request, ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_request(request, ResponsesRequest)

    @app.post("/inference/v1/generate")
    async def inference_generate(request: Request) -> Response:
        return await serve_request(request, GenerateRequest)

    add_weight_routes(app, engine, metrics.registry, max_request_bytes)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        return await serve_request(request, invocation_model)

    async def serve_tokenizer(request: Request, model, answer) -> Response:
        req = await parse_body(request, model, max_request_bytes)
        if isinstance(req, Response):
            if req.status_code == 413:
                stats.reject("too_large")
            return req
        if not assets.accepts_model(req.model):
            return error_response(f"The model `{req.model}` does not exist.", "model", 404)

        def respond() -> Response:
            try:
                body = answer(req)
            except RequestError as exc:
                return request_error_response(exc)
            return Response(dumps_in_pieces(body), media_type="application/json")

        return await off_loop(respond)

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


def log_request(route: str, prepared: Any) -> None:
    """One line per admitted request: route, model, each choice's prompt length, the first
    choice's sampling parameters (vLLM's "Received request" line)."""
    jobs = prepared.jobs
    request_log.info("received request %s: model=%r, choices=%d, prompt_tokens=%s, params=%s",
                     route, prepared.request.model, len(jobs),
                     [len(job.prompt_ids) for job in jobs], jobs[0].params if jobs else None)


def invocation_model(data: dict[str, Any]) -> type[BaseModel]:
    """vLLM's /invocations (SageMaker's route): a body with `messages` is a chat completion,
    any other a completion, answered as on its own route."""
    return ChatCompletionRequest if "messages" in data else CompletionRequest


def finish_reasons(body: dict[str, Any]) -> list[str | None]:
    """Each choice's finish reason (a Response has one output: its status says which)."""
    if body.get("object") == "response":
        return ["length" if body["status"] == "incomplete" else "stop"]
    return [choice.get("finish_reason") for choice in body["choices"]]


class TrackedStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` once it ends, however it ends (finished,
    failed, cancelled because the client went away, or never started)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()


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
