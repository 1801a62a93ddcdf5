"""POST /v1/completions in vLLM's wire format (non-streaming and SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ranks.requests import RequestError
from runtime.engine.client import EngineClient
from runtime.http.assets import ModelAssets
from runtime.http.choices import ChoiceJob, Delta, Totals, collect, envelope, stream_chunks
from runtime.http.params import (
    build_params,
    check_choices,
    check_request,
    check_stops,
    choice_seed,
    resolve_max_tokens,
    wire_mode,
)
from runtime.http.protocol import CompletionRequest
from runtime.http.wire import Position, WireMode, completion_logprobs
from runtime.text.detokenizer import detokenize

DEFAULT_MAX_TOKENS = 16


@dataclass
class PreparedCompletion:
    request: CompletionRequest
    jobs: list[ChoiceJob]
    echo_texts: dict[int, str]
    prompt_tokens: dict[int, int]
    """Prompt tokens by choice index (usage counts each prompt once)."""
    total_prompt_tokens: int
    mode: WireMode | None
    """None: no logprobs requested."""


def _check_logprobs(req: CompletionRequest) -> None:
    """The endpoint's own pairing rules; ranges and what the core serves are checked once,
    by the engine."""
    if req.logprob_token_ids is not None and req.logprobs is None:
        raise RequestError(
            "logprob_token_ids", "when using logprob_token_ids, logprobs must be set"
        )
    if req.echo and (req.logprobs is not None or req.logprob_token_ids is not None):
        raise RequestError(
            "echo",
            "echo with logprobs needs prompt logprobs, which this core cannot compute (it has no "
            "prompt scoring buffers); request echo or logprobs, not both",
        )


def _prompts(req: CompletionRequest, assets: ModelAssets) -> list[tuple[str | None, list[int]]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise RequestError("prompt", "the prompt must not be empty")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise RequestError("prompt", "the prompt must not be empty")
            ids = assets.encode(item, add_special_tokens=req.add_special_tokens, param="prompt")
            out.append((item, ids))
        else:
            out.append((None, list(item)))
    return out


def prepare_completion(
    req: CompletionRequest, engine: EngineClient, assets: ModelAssets
) -> PreparedCompletion:
    """Everything refused before admission raises RequestError here (HTTP 400)."""
    check_request(req)
    _check_logprobs(req)
    stops = req.stop_strings()
    check_stops(stops)
    prompts = _prompts(req, assets)
    check_choices(req.n, len(prompts))
    info = engine.info
    explicit = req.max_tokens if "max_tokens" in req.model_fields_set else None
    jobs, echo_texts, prompt_tokens = [], {}, {}
    total = 0
    for p, (text, ids) in enumerate(prompts):
        if not ids:
            raise RequestError("prompt", "the prompt must contain at least one token")
        max_tokens = resolve_max_tokens(
            explicit, len(ids), info.max_model_len, "max_tokens",
            default=DEFAULT_MAX_TOKENS, allow_zero=bool(req.echo),
        )
        total += len(ids)
        echo = None
        if req.echo:
            echo = text if text is not None else detokenize(
                assets.token_bytes, ids, skip_special_tokens=req.skip_special_tokens
            )[0]
        for i in range(req.n):
            params = build_params(
                req, max_tokens=max_tokens, logprobs=req.logprobs,
                logprob_token_ids=req.logprob_token_ids, seed=choice_seed(req.seed, i),
            )
            if i == 0:
                engine.check(ids, params)
            index = p * req.n + i
            jobs.append(ChoiceJob(
                index, ids, params, stops, req.include_stop_str_in_output,
                req.skip_special_tokens, offset_base=len(echo) if echo else 0,
            ))
            prompt_tokens[index] = len(ids)
            if echo is not None:
                echo_texts[index] = echo
    mode = wire_mode(req, req.logprobs is not None)
    return PreparedCompletion(req, jobs, echo_texts, prompt_tokens, total, mode)


def _logprobs(prep: PreparedCompletion, items: list[Position], assets: ModelAssets):
    if prep.mode is None:
        return None
    return completion_logprobs(items, assets.token_bytes, prep.mode)


async def complete(prep: PreparedCompletion, engine: EngineClient, assets: ModelAssets) -> dict:
    """The whole response; raises EngineError (or another error) after admission."""
    totals = Totals(prep.total_prompt_tokens)
    outcomes = await collect(prep.jobs, engine, assets, totals, prep.echo_texts)
    choices = [{
        "index": out.index,
        "text": out.text,
        "logprobs": _logprobs(prep, out.positions, assets),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "prompt_logprobs": None,
    } for out in outcomes]
    return {
        **envelope("cmpl", "text_completion", assets),
        "choices": choices,
        "usage": totals.usage(),
        "system_fingerprint": None,
    }


def stream_completion(
    prep: PreparedCompletion, engine: EngineClient, assets: ModelAssets
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects (the caller encodes them as SSE, adds errors and [DONE])."""

    def choice(index: int, text: str, delta: Delta) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": _logprobs(prep, delta.positions, assets),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    return stream_chunks(
        prep.jobs, engine, assets, id_prefix="cmpl", obj="text_completion",
        options=prep.request.stream_options, totals=Totals(prep.total_prompt_tokens),
        prompt_tokens=prep.prompt_tokens, choice=choice, prefixes=prep.echo_texts,
    )
