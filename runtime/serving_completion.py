"""POST /v1/completions in vLLM's wire format (non-streaming and SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from runtime.detokenizer import detokenize
from runtime.engine_api import Engine, RequestError
from runtime.protocol import CompletionRequest
from runtime.serving import (
    ChoiceJob,
    Delta,
    ModelAssets,
    Totals,
    build_params,
    check_choices,
    check_stops,
    choice_seed,
    merge,
    new_id,
    now,
    resolve_max_tokens,
    run_choice,
)
from runtime.wire import Position, WireMode, completion_logprobs

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


def _check_logprobs(req: CompletionRequest, engine: Engine) -> None:
    info = engine.info
    if req.logprobs is not None or req.logprob_token_ids is not None:
        if not info.allow_logprobs:
            raise RequestError(
                "logprobs", "this model's core has no logprob outputs (K=0): logprobs are refused"
            )
    if req.logprobs is not None and not 0 <= req.logprobs <= info.max_logprobs:
        raise RequestError("logprobs", f"must be in [0, {info.max_logprobs}], got {req.logprobs}")
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
    req: CompletionRequest, engine: Engine, assets: ModelAssets
) -> PreparedCompletion:
    """Everything refused before admission raises RequestError here (HTTP 400)."""
    unsupported = req.unsupported() or (
        ("suffix", "suffix is not supported by this server") if req.suffix else None
    )
    if unsupported:
        raise RequestError(*unsupported)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options", "stream_options can only be set when stream=true")
    _check_logprobs(req, engine)
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
    mode = None
    if req.logprobs is not None:
        selected = req.logprob_token_ids is not None
        mode = WireMode(selected, bool(req.return_tokens_as_token_ids))
    return PreparedCompletion(req, jobs, echo_texts, prompt_tokens, total, mode)


def _streams(prep: PreparedCompletion, engine: Engine, assets: ModelAssets) -> list:
    return [run_choice(engine, job, assets.token_bytes) for job in prep.jobs]


def _logprobs(prep: PreparedCompletion, items: list[Position], assets: ModelAssets):
    if prep.mode is None:
        return None
    return completion_logprobs(items, assets.token_bytes, prep.mode)


async def complete(prep: PreparedCompletion, engine: Engine, assets: ModelAssets) -> dict:
    """The whole response; raises EngineError (or another error) after admission."""
    texts: dict[int, list[str]] = {job.index: [prep.echo_texts.get(job.index, "")]
                                   for job in prep.jobs}
    items: dict[int, list[Position]] = {job.index: [] for job in prep.jobs}
    ends: dict[int, Delta] = {}
    totals = Totals(prep.total_prompt_tokens)
    indices = [job.index for job in prep.jobs]
    async for k, delta in merge(_streams(prep, engine, assets)):
        index = indices[k]
        texts[index].append(delta.text)
        items[index].extend(delta.positions)
        totals.add(index, delta)
        if delta.finish_reason is not None:
            ends[index] = delta
    choices = []
    for index in indices:
        end = ends.get(index)
        choices.append({
            "index": index,
            "text": "".join(texts[index]),
            "logprobs": _logprobs(prep, items[index], assets),
            "finish_reason": end.finish_reason if end else None,
            "stop_reason": end.stop_reason if end else None,
            "prompt_logprobs": None,
        })
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": assets.served_model_name,
        "choices": choices,
        "usage": totals.usage(),
        "system_fingerprint": None,
    }


async def stream_completion(
    prep: PreparedCompletion, engine: Engine, assets: ModelAssets
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects (the caller encodes them as SSE, adds errors and [DONE])."""
    req = prep.request
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
            "model": assets.served_model_name}
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    totals = Totals(prep.total_prompt_tokens)
    indices = [job.index for job in prep.jobs]
    echo = dict(prep.echo_texts)
    async for k, delta in merge(_streams(prep, engine, assets)):
        index = indices[k]
        totals.add(index, delta)
        text = echo.pop(index, "") + delta.text
        if not text and not delta.positions and delta.finish_reason is None:
            continue
        choice = {
            "index": index,
            "text": text,
            "logprobs": _logprobs(prep, delta.positions, assets),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        chunk = {**head, "choices": [choice]}
        if continuous:
            prompt = prep.prompt_tokens[index]
            done = totals.per_choice.get(index, 0)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                              "total_tokens": prompt + done}
        yield chunk
    if include_usage:
        yield {**head, "choices": [], "usage": totals.usage()}

