"""One offline request of launch.generate, answered as the server answers it.

A request is one of:

* a Completions body (``prompt``: text, token ids, or a list of either) or a Chat Completions
  body (``messages``): the same fields, defaults and validation as POST /v1/completions and
  POST /v1/chat/completions (runtime/http/protocol, runtime/http/endpoints), and the same
  response object: choices with text, logprobs, finish reasons, usage. ``model`` may be left
  out; ``stream`` is refused.
* ``{"prompt_ids": [...], "params": {SamplingParams fields}}``: the engine's own request, as
  before: per request ``{"text", "tokens": [{"index", "token_id", "logprob", "alternatives":
  [[id, logprob], ...]}], "finish": {...}}`` (``text`` null for a checkpoint without a
  tokenizer, which serves this form only); a -inf logprob is written as -9999.0, as on the
  wire.

A request that is refused, or that fails, gets ``{"error": {"message", "type", "param",
"code"}}`` (OpenAI's error object, the server's message) in its own place; the others are
answered.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from pydantic import ValidationError

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.bodies import validation_error
from helios_logprobs.runtime.http.endpoints.chat import chat, prepare_chat
from helios_logprobs.runtime.http.endpoints.completions import complete, prepare_completion
from helios_logprobs.runtime.http.protocol.models import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from helios_logprobs.runtime.http.responses import failure_message, request_error_response
from helios_logprobs.runtime.outputs import EngineError


def _value(x: float) -> float:
    return -9999.0 if x == -math.inf else x


def _refusal(response) -> dict[str, Any]:
    return json.loads(response.body)


async def answer(engine, assets: ModelAssets | None, item: Any) -> dict[str, Any]:
    """The result of one request (never raises for a bad request or a failed one).
    ``assets`` None: a checkpoint without a tokenizer, which serves token ids only."""
    if not isinstance(item, dict):
        return error_body("each request must be a JSON object", None)
    if "prompt_ids" in item:
        return await asyncio.to_thread(run_ids, engine, assets, item)
    if assets is None:
        return error_body("this checkpoint has no tokenizer.json: only prompt_ids requests "
                          "are served", None)
    kind = ChatCompletionRequest if "messages" in item else CompletionRequest
    prepare, whole = (prepare_chat, chat) if kind is ChatCompletionRequest else (
        prepare_completion, complete)
    try:
        req = kind.model_validate(item)
        if req.stream:
            raise RequestError("stream", "stream: offline generation writes whole responses")
        if not assets.accepts_model(req.model):
            return error_body(f"The model `{req.model}` does not exist.", "model", 404)
        prepared = await asyncio.to_thread(prepare, req, engine, assets)
        return await whole(prepared, engine, assets)
    except ValidationError as exc:
        return _refusal(validation_error(exc))
    except RequestError as exc:
        return _refusal(request_error_response(exc))
    except EngineError as exc:
        return error_body(failure_message(exc), None, 500)


def engine_params(raw: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a JSON object; an unknown field or a bad value is a RequestError."""
    raw = dict(raw)
    if "logit_bias" in raw:
        raw["logit_bias"] = tuple((int(t), float(b)) for t, b in raw["logit_bias"])
    for key in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    if "bad_words" in raw:
        raw["bad_words"] = tuple(tuple(word) for word in raw["bad_words"])
    try:
        return SamplingParams(**raw)
    except TypeError as exc:  # an unknown field
        raise RequestError("params", f"params: {exc}") from None


def run_ids(engine, assets: ModelAssets | None, item: dict[str, Any]) -> dict[str, Any]:
    """A ``prompt_ids`` request (blocks: run it in a thread); ``text`` needs a tokenizer."""
    try:
        params = item.get("params", {})
        if not isinstance(params, dict):
            raise RequestError("params", "params: expected a JSON object")
        prompt = item["prompt_ids"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise RequestError("prompt_ids", "prompt_ids: expected a list of token ids")
        tokens, finish = engine.generate_sync(prompt, engine_params(params))
    except RequestError as exc:
        return _refusal(request_error_response(exc))
    except (TypeError, ValueError) as exc:
        return error_body(f"params: {exc}", "params")
    except EngineError as exc:
        return error_body(failure_message(exc), None, 500)
    ids = [t.token_id for t in tokens]
    text = None if assets is None else assets.tokenizer.decode(ids, skip_special_tokens=True)
    return {
        "text": text,
        "tokens": [
            {
                "index": t.index,
                "token_id": t.token_id,
                "logprob": None if t.logprob is None else _value(t.logprob),
                "alternatives": [[a.token_id, _value(a.logprob)] for a in t.alternatives],
            }
            for t in tokens
        ],
        "finish": {"reason": finish.reason, "stop_token_id": finish.stop_token_id},
    }


async def answer_all(engine, assets: ModelAssets | None, items: list[Any]) -> list[dict[str, Any]]:
    """Every request at once (the engine batches them), results in request order."""
    return list(await asyncio.gather(*(answer(engine, assets, item) for item in items)))
