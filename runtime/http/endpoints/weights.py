"""vLLM's weight-sync routes for RL (vllm/entrypoints/serve/dev/rlhf/): POST /pause
(``?mode=abort|wait|keep``), POST /resume, GET /is_paused, POST
/init_weight_transfer_engine (``{"init_info": {master_address, master_port, rank_offset,
world_size}}``: join a trainer's group) and POST /update_weights, whose ``update_info`` is
either ``{"model_path": "<checkpoint folder>"}`` (a safetensors folder of the served layout,
each rank reading only its shard) or vLLM's ``{"names", "dtype_names", "shapes"}`` (the
trainer then broadcasts those tensors, in that order). Order: pause, update, resume. The
operations run on the engine core (runtime/engine/weight_update.py); /metrics counts the
updates (``helios:rl_weight_update_total``, vLLM's ``vllm:rl_weight_update_total``, and
``helios:rl_weight_update_failures_total``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from helios_logprobs.runtime.engine.pause import PAUSE_MODES
from helios_logprobs.runtime.engine.weight_update import WeightControl
from helios_logprobs.runtime.http.bodies import parse_body
from helios_logprobs.runtime.http.metrics import PREFIX
from helios_logprobs.runtime.http.protocol.models import OpenAIModel
from helios_logprobs.runtime.http.responses import error_response, json_response
from helios_logprobs.runtime.outputs import EngineError


class UpdateWeightsRequest(OpenAIModel):
    """vLLM's /update_weights body: the source is described by ``update_info``."""

    update_info: dict[str, Any]


class InitWeightTransferRequest(OpenAIModel):
    """vLLM's /init_weight_transfer_engine body."""

    init_info: dict[str, Any]


async def control(engine: Any, op: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """An operation on the engine core: over the frontend sockets from an API server, else
    on this process's engine (in a worker thread: a pause may wait for requests)."""
    remote = getattr(engine, "control", None)
    if remote is not None:
        return await remote(op, args)
    return await asyncio.to_thread(WeightControl.for_engine(engine).handle, op, args)


def _answer(status: int, body: dict[str, Any]) -> Response:
    if status == 200:
        return json_response(body)
    return error_response(body.get("error", "failed"), body.get("param"), status)


def _flag(raw: str | None, name: str) -> bool | None:
    if raw is None:
        return None
    if raw.lower() in ("true", "1"):
        return True
    if raw.lower() in ("false", "0"):
        return False
    raise ValueError(f"{name} must be true or false, got {raw!r}")


class WeightUpdateCollector:
    """The engine core's update counters and pause state, at each scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def counts(self) -> dict[str, int]:
        own = getattr(self.engine, "weight_updates", None)
        if isinstance(own, dict):
            return own
        counters = getattr(getattr(self.engine, "stats", None), "counters", {})
        return {"succeeded": counters.get("rl_weight_update_succeeded", 0),
                "failed": counters.get("rl_weight_update_failed", 0)}

    def collect(self) -> Iterator[Metric]:
        counts = self.counts()
        yield CounterMetricFamily(PREFIX + "rl_weight_update", "Completed weight updates "
                                  "(POST /update_weights)", value=counts.get("succeeded", 0))
        yield CounterMetricFamily(PREFIX + "rl_weight_update_failures", "Refused or failed "
                                  "weight updates (the served weights unchanged)",
                                  value=counts.get("failed", 0))
        paused = getattr(self.engine, "is_paused", None)
        if callable(paused) and not hasattr(self.engine, "control"):  # (in-process only)
            yield GaugeMetricFamily(PREFIX + "is_paused", "1 while generation is paused",
                                    value=int(paused()))


def add_weight_routes(app: FastAPI, engine: Any, registry, max_request_bytes: int) -> None:
    """The routes above, and the counters in ``registry`` (the app's /metrics)."""
    registry.register(WeightUpdateCollector(engine))

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        query = request.query_params
        try:
            wait = _flag(query.get("wait_for_inflight_requests"), "wait_for_inflight_requests")
        except ValueError as exc:
            return error_response(str(exc), "wait_for_inflight_requests")
        mode = query.get("mode", "wait" if wait else "abort")
        if mode not in PAUSE_MODES:
            return error_response(f"mode must be one of {', '.join(PAUSE_MODES)}, got "
                                  f"{mode!r}", "mode")
        return await _call("pause", {"mode": mode})

    @app.post("/resume")
    async def resume() -> Response:
        return await _call("resume", {})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return await _call("is_paused", {})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        req = await parse_body(request, UpdateWeightsRequest, max_request_bytes)
        if isinstance(req, Response):
            return req
        info = req.update_info
        if "names" not in info and not (isinstance(info.get("model_path"), str)
                                        and info["model_path"]):
            return error_response("update_info.model_path: a checkpoint folder (a string) is "
                                  "required, or names, dtype_names and shapes",
                                  "update_info.model_path")
        return await _call("update_weights", {"update_info": info})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer(request: Request) -> Response:
        req = await parse_body(request, InitWeightTransferRequest, max_request_bytes)
        if isinstance(req, Response):
            return req
        return await _call("init_weight_transfer", {"init_info": req.init_info})

    async def _call(op: str, args: dict[str, Any]) -> Response:
        try:
            status, body = await control(engine, op, args)
        except EngineError as exc:
            return error_response(str(exc), None, 503)
        return _answer(status, body)
