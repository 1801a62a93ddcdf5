"""Glue shared by both endpoints: request fields -> SamplingParams, one engine request per choice
-> detokenizer + stop filter -> `Delta`s, bounded merging of choices, JSON/SSE encoding.

Nothing here keeps a response history: a choice's stream holds only what the detokenizer and
the stop filter cannot release yet, and merged choices pass through a bounded queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from runtime.text.chat_template import ChatTemplate
from runtime.engine.client import (
    Engine,
    EngineError,
    Finished,
    GeneratedToken,
    RequestError,
    SamplingParams,
)
from runtime.http.protocol import (
    MAX_CHOICES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    SamplingFields,
    error_body,
)
from runtime.text.stops import OutputStream
from runtime.text.token_bytes import TokenBytes
from runtime.http.wire import NonFiniteLogprob, Position, positions

log = logging.getLogger("runtime.http.serving")
LOGIT_BIAS_LIMIT = 100.0
MERGE_QUEUE = 32


class ModelAssets:
    """What presentation needs from the model directory."""

    def __init__(self, model_dir: str | Path, served_model_name: str, vocab_size: int) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.tokenizer = tokenizers.Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.token_bytes = TokenBytes(self.tokenizer, vocab_size)
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(param, f"text is not valid Unicode: {exc.reason}") from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def accepts_model(self, name: str | None) -> bool:
        return name in (None, "", self.served_model_name, str(self.model_dir))


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def dumps(obj: Any) -> str:
    """Strict JSON: NaN or Infinity anywhere is a bug and raises ValueError."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def parse_logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    pairs: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise RequestError("logit_bias", f"key {key!r} is not a token id") from None
        if token_id in pairs:
            raise RequestError("logit_bias", f"token id {token_id} appears more than once")
        pairs[token_id] = min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return tuple(pairs.items())


def check_stops(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if len(stop) > MAX_STOP_LENGTH:
            raise RequestError("stop", f"stop strings are limited to {MAX_STOP_LENGTH} characters")


def check_choices(n: int, prompts: int) -> None:
    if n * prompts > MAX_CHOICES:
        raise RequestError("n", f"n times the number of prompts must be at most {MAX_CHOICES}")


def build_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    logprob_token_ids: list[int] | None,
    seed: int | None,
) -> SamplingParams:
    """SamplingParams for one choice (its __post_init__ raises RequestError naming the field)."""
    allowed = None
    if req.allowed_token_ids is not None:
        allowed = tuple(dict.fromkeys(req.allowed_token_ids))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=parse_logit_bias(req.logit_bias),
        allowed_token_ids=allowed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=None if logprob_token_ids is not None else logprobs,
        logprob_token_ids=None if logprob_token_ids is None else tuple(logprob_token_ids),
    )


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request uses seed + i (so n > 1 choices differ)."""
    return None if seed is None else seed + index


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str,
    *,
    default: int | None = None,
    allow_zero: bool = False,
    prompt_param: str = "prompt",
) -> int:
    """The request's max_tokens; 400 when it does not fit the context (vLLM's rule). Without
    one: `default` (clipped to the room left), else all of the room left."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            prompt_param,
            f"{prompt_len} prompt tokens leave no room in the maximum context length of "
            f"{max_model_len} tokens",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested < (0 if allow_zero else 1):
        raise RequestError(param, f"must be at least {0 if allow_zero else 1}, got {requested}")
    if requested > room:
        raise RequestError(
            param,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, leaving room for at most {room}, but {requested} were requested",
        )
    return requested


@dataclass
class ChoiceJob:
    """One choice: one engine request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    offset_base: int = 0
    """Added to every text offset (the echoed prompt's length in characters)."""


@dataclass
class Delta:
    text: str
    positions: list[Position]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tokens: int = 0
    """Generated tokens this delta accounts for (usage), terminating stop tokens included."""


@dataclass
class Totals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_choice: dict[int, int] = field(default_factory=dict)

    def add(self, index: int, delta: Delta) -> None:
        self.completion_tokens += delta.tokens
        self.per_choice[index] = self.per_choice.get(index, 0) + delta.tokens

    def usage(self, completion_tokens: int | None = None) -> dict[str, int]:
        done = self.completion_tokens if completion_tokens is None else completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }


def stop_reason_of(
    finished: Finished, params: SamplingParams, eos_ids: Sequence[int]
) -> int | None:
    """vLLM's stop_reason for a token stop: the id for stop_token_ids, None for EOS."""
    token = finished.stop_token_id
    if token is None or token not in params.stop_token_ids:
        return None
    if token in eos_ids and not params.ignore_eos:
        return None
    return token


async def run_choice(engine: Engine, job: ChoiceJob, tb: TokenBytes) -> AsyncIterator[Delta]:
    """Engine events -> deltas; ends the engine request early when a stop string matches."""
    stream = OutputStream(
        tb,
        job.stops,
        include_stop_str_in_output=job.include_stop_str_in_output,
        skip_special_tokens=job.skip_special_tokens,
        prompt_ids=job.prompt_ids,
    )
    eos_ids = engine.info.eos_token_ids
    async with aclosing(engine.generate(job.prompt_ids, job.params)) as events:
        async for event in events:
            if isinstance(event, GeneratedToken):
                chunk = stream.push(event)
                delta = Delta(chunk.text, positions(chunk.entries, job.offset_base), tokens=1)
                if chunk.stop is not None:
                    delta.finish_reason, delta.stop_reason = "stop", chunk.stop
                    yield delta
                    return
                yield delta
            else:
                chunk = stream.finish(event)
                yield Delta(
                    chunk.text,
                    positions(chunk.entries, job.offset_base),
                    finish_reason=event.reason,
                    stop_reason=stop_reason_of(event, job.params, eos_ids),
                    tokens=0 if event.stop_token_id is None else 1,
                )
                return


_END = object()


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the choices' deltas through a bounded queue; errors propagate."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue(MERGE_QUEUE)

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with aclosing(stream) as source:
                async for delta in source:
                    await queue.put((index, delta))
            await queue.put((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE lines for chunk objects; a failure after admission becomes an error event; [DONE]."""
    try:
        async with aclosing(chunks) as source:
            async for chunk in source:
                yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - reported to the client, then [DONE]
        log.warning("streamed request failed: %s", exc)
        yield sse(error_body(failure_message(exc), None, 500))
    yield SSE_DONE


def failure_message(exc: BaseException) -> str:
    if isinstance(exc, NonFiniteLogprob):
        return f"request failed: {exc}"
    if isinstance(exc, EngineError):
        return str(exc) or "request failed in the engine"
    return f"request failed: {type(exc).__name__}: {exc}"
