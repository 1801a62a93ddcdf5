"""POST /inference/v1/generate: vLLM's token-in/token-out endpoint (its GenerateRequest and
GenerateResponse, vllm/entrypoints/serve/disagg/): prompt token ids and vLLM's
SamplingParams in; each choice's generated token ids (a terminating EOS or stop token
included, as vLLM's outputs hold it) and logprobs out; nothing is tokenized or detokenized.

Logprobs are chat-shaped (`{"content": [{"token": "token_id:N", "logprob", "bytes": null,
"top_logprobs": [...]}]}`), one entry per generated id, the terminating stop token included
(the engine scores it: SamplingParams.stop_token_entry); `top_logprobs` lists, as vLLM's
generate does, the sampled token first, then the most likely other ids in rank order,
max(logprobs, 1) entries in all. The values are the engine's, as every
endpoint reports them: equal, bit for bit, to /v1/completions' for the same prompt and
sampling. Streamed (`"stream": true`), one SSE chunk per generated id (a choice's last id
carries its finish reason), then a usage chunk with stream_options.include_usage, then
[DONE]. Refusals: HTTP 400 naming the field (`token_ids`, `sampling_params.<name>`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.ranks.contract.requests import RequestError, check_token_ids
from helios_logprobs.runtime.engine.client import EngineClient, SamplingParams
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.endpoints.generate_request import (
    REFUSED,
    SP,
    GenerateRequest,
    GenerateSampling,
)
from helios_logprobs.runtime.http.output.wire import (
    prompt_logprobs_list,
    wire_entropy,
    wire_logprob,
)
from helios_logprobs.runtime.http.protocol.models import MAX_CHOICES
from helios_logprobs.runtime.http.protocol.params import (
    bad_word_ids,
    choice_seed,
    parse_logit_bias,
    resolve_max_tokens,
)
from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.outputs import (
    EngineError,
    Finished,
    GeneratedToken,
    PromptScores,
)


@dataclass(frozen=True)
class GenerateJob:
    index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def usage(self, completion_tokens: int | None = None) -> dict[str, int]:
        done = self.completion_tokens if completion_tokens is None else completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}


@dataclass
class PreparedGenerate:
    request: GenerateRequest
    jobs: list[GenerateJob]
    request_id: str
    mode: WireMode | None
    totals: Usage
    per_choice: dict[int, int] = field(default_factory=dict)


def _sampling_error(exc: RequestError) -> RequestError:
    """An engine refusal, named as the field of this request."""
    if exc.param == "prompt":
        return RequestError("token_ids", exc.message)
    return RequestError(exc.param if exc.param.startswith(SP) else f"{SP}.{exc.param}",
                        exc.message)


def _check_fields(sp: GenerateSampling, request: GenerateRequest) -> None:
    if request.features is not None:
        raise RequestError("features", "multimodal features are not supported")
    options = request.stream_options
    if options is not None and (options.model_fields_set or options.model_extra) \
            and not request.stream:
        raise RequestError("stream_options",
                           "Stream options can only be defined when `stream=True`.")
    for name, neutral in REFUSED.items():
        if getattr(sp, name) not in neutral:
            why = ("stop strings need detokenized text: use stop_token_ids"
                   if name == "stop" else "not supported by this server")
            raise RequestError(f"{SP}.{name}", why)
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(sp, name) <= 2.0:
            raise RequestError(f"{SP}.{name}", f"{name} must be in [-2, 2], got "
                                               f"{getattr(sp, name)}.")
    if sp.n > MAX_CHOICES:
        raise RequestError(f"{SP}.n", f"n must be at most {MAX_CHOICES}, got {sp.n}")
    if sp.n > 1 and sp.temperature == 0:
        raise RequestError(f"{SP}.n", f"n must be 1 when using greedy sampling, got {sp.n}.")
    if sp.prompt_logprobs is not None and request.stream:
        raise RequestError(f"{SP}.prompt_logprobs",
                           "`prompt_logprobs` are not available when `stream=True`.")


def prepare_generate(req: GenerateRequest, engine: EngineClient, assets: ModelAssets
                     ) -> PreparedGenerate:
    """Everything refused before admission raises RequestError here (HTTP 400)."""
    sp = req.sampling_params
    _check_fields(sp, req)
    info = engine.info
    ids = list(req.token_ids)
    if not ids:
        raise RequestError("token_ids", "token_ids must hold at least one token id")
    check_token_ids("token_ids", ids, min(info.vocab_size, assets.token_bytes.size))
    max_tokens = resolve_max_tokens(sp.max_tokens, len(ids), info.max_model_len,
                                    f"{SP}.max_tokens", prompt_param="token_ids")
    try:
        bias = parse_logit_bias(sp.logit_bias)
        bad_words = bad_word_ids(sp.bad_words, assets.word_ids)
    except RequestError as exc:
        raise _sampling_error(exc) from None
    jobs = []
    for index in range(sp.n):
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                top_k=sp.top_k, min_p=sp.min_p, seed=choice_seed(sp.seed, index),
                presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                repetition_penalty=sp.repetition_penalty, logit_bias=bias,
                allowed_token_ids=None if sp.allowed_token_ids is None
                else tuple(dict.fromkeys(sp.allowed_token_ids)),
                stop_token_ids=tuple(sp.stop_token_ids or ()), ignore_eos=sp.ignore_eos,
                min_tokens=sp.min_tokens, bad_words=bad_words, logprobs=sp.logprobs,
                prompt_logprobs=sp.prompt_logprobs,
                thinking_token_budget=sp.thinking_token_budget, stop_token_entry=True,
                return_entropy=sp.return_entropy,
            )
            engine.check(ids, params)  # the one validation path, for every choice
        except RequestError as exc:
            raise _sampling_error(exc) from None
        jobs.append(GenerateJob(index, ids, params))
    request_id = req.request_id or uuid.uuid4().hex
    mode = WireMode(False, True, sp.return_entropy) if sp.logprobs is not None else None
    return PreparedGenerate(req, jobs, request_id, mode, Usage(len(ids)))


def _entry(token: GeneratedToken, top_n: int, mode: WireMode) -> dict[str, Any]:
    """One entry; with return_entropy, its ``entropy`` (null for a forced token)."""
    token_id, logprob = token.token_id, token.logprob
    if logprob is None:  # (a forced token: no logprob, as vLLM leaves an entry bare)
        entry = {"token": f"token_id:{token_id}", "logprob": -9999.0, "bytes": None,
                 "top_logprobs": []}
    else:
        # vLLM's order: the sampled token first, then the most likely others, max(N, 1) in
        # all (its dict of the sampled id then the top N, cut to N: a sampled id outside the
        # top N pushes the N-th out; logprobs=0 lists the sampled token alone).
        chosen = {"token": f"token_id:{token_id}", "logprob": wire_logprob(logprob),
                  "bytes": None}
        others = [{"token": f"token_id:{alt.token_id}", "logprob": wire_logprob(alt.logprob),
                   "bytes": None} for alt in token.alternatives if alt.token_id != token_id]
        entry = {**chosen, "top_logprobs": [dict(chosen), *others][: max(top_n, 1)]}
    if mode.entropy:
        entry["entropy"] = None if logprob is None else wire_entropy(token.entropy)
    return entry


@dataclass
class ChoiceEvents:
    """One choice's output so far: ids, logprob entries, prompt scores, finish reason."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    prompt: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(frozen=True)
class Item:
    """One engine event of one choice."""

    index: int
    token_id: int | None = None
    """A generated id, or the terminating stop token's (with ``reason``)."""
    entry: dict[str, Any] | None = None
    reason: str | None = None
    prompt: tuple = ()
    last: bool | None = None
    """GeneratedToken.last: False when another token surely follows."""


async def _events(prep: PreparedGenerate, job: GenerateJob, engine: EngineClient
                  ) -> AsyncIterator[Item]:
    top_n = prep.request.sampling_params.logprobs or 0
    wants = prep.mode is not None
    async with aclosing(engine.generate(job.prompt_ids, job.params)) as events:
        async for event in events:
            if isinstance(event, PromptScores):
                yield Item(job.index, prompt=tuple(event.entries))
            elif isinstance(event, GeneratedToken):
                entry = _entry(event, top_n, prep.mode) if wants else None
                yield Item(job.index, event.token_id, entry, last=event.last)
            elif isinstance(event, Finished):
                stop, entry = event.stop_token_id, None
                if stop is not None and wants and event.entry is not None:
                    entry = _entry(event.entry, top_n, prep.mode)
                yield Item(job.index, stop, entry, event.reason)
                return
    raise EngineError("the engine ended a request without finishing it")


async def _merged(prep: PreparedGenerate, engine: EngineClient):
    """Every choice's events, as they come (one task per choice)."""
    if len(prep.jobs) == 1:
        async with aclosing(_events(prep, prep.jobs[0], engine)) as one:
            async for item in one:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job: GenerateJob) -> None:
        try:
            async with aclosing(_events(prep, job, engine)) as events:
                async for item in events:
                    await queue.put(item)
            await queue.put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(job)) for job in prep.jobs]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _choice(out: ChoiceEvents, prep: PreparedGenerate) -> dict[str, Any]:
    logprobs = {"content": out.entries} if prep.mode is not None else None
    return {"index": out.index, "logprobs": logprobs, "finish_reason": out.finish_reason,
            "token_ids": out.token_ids}


async def generate_whole(prep: PreparedGenerate, engine: EngineClient, assets: ModelAssets
                         ) -> dict[str, Any]:
    outs = {job.index: ChoiceEvents(job.index) for job in prep.jobs}
    async with aclosing(_merged(prep, engine)) as items:
        async for item in items:
            out = outs[item.index]
            out.prompt.extend(item.prompt)
            if item.token_id is not None:
                out.token_ids.append(item.token_id)
                prep.totals.completion_tokens += 1
                if item.entry is not None:
                    out.entries.append(item.entry)
            if item.reason is not None:
                out.finish_reason = item.reason
    prompt_logprobs = None
    sp = prep.request.sampling_params
    if sp.prompt_logprobs is not None:
        scores = [None, *outs[0].prompt]
        prompt_logprobs = prompt_logprobs_list(scores, assets.token_bytes, sp.prompt_logprobs,
                                               WireMode(False, True), prep.jobs[0].prompt_ids)
    return {"request_id": prep.request_id,
            "choices": [_choice(outs[job.index], prep) for job in prep.jobs],
            "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None,
            "usage": prep.totals.usage()}


async def stream_generate(prep: PreparedGenerate, engine: EngineClient, assets: ModelAssets
                          ) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects: one per generated id, a choice's last one with its finish reason. An id
    after which the request may end without another token is held until the next event, so
    the finish reason rides on it (vLLM's last chunk carries both)."""
    options = prep.request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    held: dict[int, ChoiceEvents] = {}
    counts = prep.per_choice

    def chunk(out: ChoiceEvents) -> dict[str, Any]:
        body = {"request_id": prep.request_id, "choices": [_choice(out, prep)]}
        if continuous:
            body["usage"] = prep.totals.usage(counts.get(out.index, 0))
        return body

    async with aclosing(_merged(prep, engine)) as items:
        async for item in items:
            index = item.index
            if item.token_id is None and item.reason is None:
                continue  # (prompt scores: refused with stream)
            pending = held.pop(index, None)
            if item.token_id is None:  # the end, without an id of its own
                out = pending or ChoiceEvents(index)
                out.finish_reason = item.reason
                yield chunk(out)
                continue
            if pending is not None:
                yield chunk(pending)
            counts[index] = counts.get(index, 0) + 1
            prep.totals.completion_tokens += 1
            out = ChoiceEvents(index, [item.token_id],
                               [item.entry] if item.entry is not None else [])
            out.finish_reason = item.reason
            if item.reason is not None or item.last is False:
                yield chunk(out)
            else:
                held[index] = out
    if include_usage:
        yield {"request_id": prep.request_id, "choices": [], "usage": prep.totals.usage()}
