"""One choice's stream (`run_choice`): engine events -> detokenizer + stop filter -> Deltas,
and `merge`, which interleaves a request's choices through a bounded queue.

A choice's stream holds only what the detokenizer and the stop filter cannot release yet plus
at most one delta it looks ahead past where the end could come next (so that the finish rides
on the last token's chunk). A choice whose engine request scores its prompt
(params.prompt_logprobs set) first yields its prompt scores, in prompt order, as deltas
without text: `Delta.prompt` holds None for prompt position 0 (no context; it rides with the
first scored chunk) and then the engine's PromptLogprob entries.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.runtime.engine.client import EngineClient, SamplingParams
from helios_logprobs.runtime.http.output.wire import Position, positions
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, PromptLogprob, PromptScores
from helios_logprobs.runtime.text.reasoning import ReasoningCounter, ReasoningTokens
from helios_logprobs.runtime.text.stops import OutputStream
from helios_logprobs.runtime.text.token_bytes import MAX_CONTEXT, TokenBytes

MERGE_QUEUE = 32


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
    prompt: list[PromptLogprob | None] = field(default_factory=list)
    """Prompt scores released in this delta, in prompt order (None: prompt position 0)."""
    token_ids: list[int] = field(default_factory=list)
    """The generated ids this delta accounts for (a terminating stop token included), for
    return_token_ids."""


@dataclass
class Totals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_choice: dict[int, int] = field(default_factory=dict)
    reasoning: ReasoningTokens | None = None
    """A server with a reasoning parser (chat, Responses): usage counts reasoning tokens."""
    reasoning_ended: bool = False
    """The prompt closed the thinking span: no generated token is reasoning."""
    counters: dict[int, ReasoningCounter] = field(default_factory=dict)
    """Each choice's reasoning-token count, fed as its tokens arrive."""

    def add(self, index: int, delta: Delta) -> None:
        self.completion_tokens += delta.tokens
        self.per_choice[index] = self.per_choice.get(index, 0) + delta.tokens
        if self.reasoning is not None and not self.reasoning_ended and delta.token_ids:
            counter = self.counters.get(index)
            if counter is None:
                counter = self.counters[index] = ReasoningCounter(self.reasoning)
            counter.feed(delta.token_ids)

    @property
    def reasoning_tokens(self) -> int:
        return sum(counter.total() for counter in self.counters.values())

    def usage(self, completion_tokens: int | None = None) -> dict[str, Any]:
        """OpenAI's usage; with a reasoning parser, vLLM's completion_tokens_details too."""
        done = self.completion_tokens if completion_tokens is None else completion_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


def primary_eos(eos_ids: Sequence[int], tokenizer_eos: int | None) -> int | None:
    """vLLM's primary EOS: the tokenizer's, else the model's first EOS id."""
    if tokenizer_eos is not None and tokenizer_eos in eos_ids:
        return tokenizer_eos
    return eos_ids[0] if eos_ids else None


def stop_reason_of(finished: Finished, params: SamplingParams, primary: int | None) -> int | None:
    """vLLM's stop_reason for a token stop: None for the primary EOS (unless ignore_eos made a
    stop_token_ids entry of it), else the id. vLLM adds the model's other EOS ids (an
    end-of-turn token in generation_config.json) to stop_token_ids, so they report their id."""
    token = finished.stop_token_id
    if token is None or (token == primary and not params.ignore_eos):
        return None
    return token


def _join(first: Delta | None, second: Delta) -> Delta:
    """`first` followed by `second` as one delta (the finish is `second`'s)."""
    if first is None:
        return second
    return Delta(
        first.text + second.text,
        first.positions + second.positions,
        finish_reason=second.finish_reason,
        stop_reason=second.stop_reason,
        tokens=first.tokens + second.tokens,
        prompt=first.prompt + second.prompt,
        token_ids=first.token_ids + second.token_ids,
    )


def _visible(delta: Delta | None) -> bool:
    return delta is not None and bool(delta.text or delta.positions or delta.prompt)


async def run_choice(engine: EngineClient, job: ChoiceJob, tb: TokenBytes,
                     tokenizer_eos: int | None = None) -> AsyncIterator[Delta]:
    """Engine events -> deltas; ends the engine request early when a stop string matches.

    vLLM's stream shape: the finish rides on the delta that carries the last text/entries, so
    this looks ahead one event where the end could come next. A visible delta (text or
    entries) goes out at once when its token says that no end can come before another token
    (GeneratedToken.last is False) and no stop string can end the output (its match may leave
    nothing visible to carry the finish); otherwise it is held until the next visible one or
    the end arrives; a delta with nothing visible (text held back by the
    detokenizer or the stop filter) is carried into the next delta (its token counts with
    it). The end is sent on its own only when it shows a token not shown yet (the token
    that completed a stop string, or carried ones); otherwise it joins the held delta (the
    text it flushes, e.g. a trailing partial character, belongs to the held token). The
    finishing delta is empty only when nothing visible was left to carry it (e.g. the first
    token is EOS). Every delta but the last is visible; a failure first releases the held
    delta. Prompt scores come first, one delta per scored chunk; prompt position 0 (None) is
    carried into the first of them.
    """
    stream = OutputStream(
        tb,
        job.stops,
        include_stop_str_in_output=job.include_stop_str_in_output,
        skip_special_tokens=job.skip_special_tokens,
        prompt_ids=job.prompt_ids,
        min_tokens=job.params.min_tokens,
    )
    primary = primary_eos(engine.info.eos_token_ids, tokenizer_eos)
    at_once = not any(job.stops)
    held: Delta | None = None
    carried: Delta | None = None

    wants_logprobs = job.params.wants_logprobs
    recent: deque[int] = deque(maxlen=MAX_CONTEXT)
    contexts: dict[int, tuple[int, ...]] = {}
    """The context of each token whose entry is not released yet (wire.Position.context)."""

    def entries(chunk) -> list:
        if not chunk.entries:
            return []
        out = positions(chunk.entries, job.offset_base, logprobs=wants_logprobs,
                        contexts=contexts)
        for token, _ in chunk.entries:
            contexts.pop(token.index, None)
        return out

    if job.params.prompt_logprobs is not None:
        carried = Delta("", [], prompt=[None])
    try:
        async with aclosing(engine.generate(job.prompt_ids, job.params)) as events:
            async for event in events:
                if isinstance(event, PromptScores):
                    delta = Delta("", [], prompt=list(event.entries))
                elif isinstance(event, GeneratedToken):
                    if wants_logprobs and event.logprob is not None:
                        contexts[event.index] = tuple(recent)
                    recent.append(event.token_id)
                    chunk = stream.push(event)
                    delta = Delta(chunk.text, entries(chunk), tokens=1,
                                  token_ids=[event.token_id])
                    if chunk.stop is not None:
                        delta.finish_reason, delta.stop_reason = "stop", chunk.stop
                else:
                    if wants_logprobs and event.entry is not None:  # (a scoring request)
                        contexts[event.entry.index] = tuple(recent)
                    chunk = stream.finish(event)
                    delta = Delta(
                        chunk.text,
                        entries(chunk),
                        finish_reason=event.reason,
                        stop_reason=stop_reason_of(event, job.params, primary),
                        tokens=0 if event.stop_token_id is None else 1,
                        token_ids=[] if event.stop_token_id is None else [event.stop_token_id],
                    )
                fresh = isinstance(event, GeneratedToken) or carried is not None
                delta, carried = _join(carried, delta), None
                if delta.finish_reason is not None:
                    if held is not None and fresh and _visible(delta):
                        out, held = held, None
                        yield out
                    last, held = _join(held, delta), None
                    yield last
                    return
                if not _visible(delta):
                    carried = delta
                    continue
                if held is not None:
                    out, held = held, None
                    yield out
                if at_once and isinstance(event, GeneratedToken) and event.last is False:
                    yield delta
                else:
                    held = delta
    except Exception:
        if held is not None:
            out, held = held, None
            yield out
        raise


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
