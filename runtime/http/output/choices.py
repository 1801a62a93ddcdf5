"""A request's choices, collected into whole outcomes (`collect`) or streamed as response
chunks (`stream_chunks`), from the merged per-choice Deltas of runtime/http/output/choice_stream.py.
Nothing here keeps a response history; the endpoints turn outcomes and chunks into their wire
shapes (prompt scores into `prompt_logprobs` or echoed positions).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.runtime.engine.client import EngineClient
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.output.choice_stream import (
    ChoiceJob,
    Delta,
    Totals,
    merge,
    run_choice,
)
from helios_logprobs.runtime.http.output.wire import Position
from helios_logprobs.runtime.http.protocol.models import StreamOptions
from helios_logprobs.runtime.http.responses import new_id, now
from helios_logprobs.runtime.outputs import PromptLogprob


def envelope(id_prefix: str, obj: str, assets: ModelAssets) -> dict[str, Any]:
    return {"id": new_id(id_prefix), "object": obj, "created": now(),
            "model": assets.served_model_name}


def _streams(jobs: list[ChoiceJob], engine: EngineClient, assets: ModelAssets) -> list:
    return [run_choice(engine, job, assets.token_bytes, assets.eos_token_id) for job in jobs]


@dataclass
class ChoiceOutcome:
    """One choice's whole output."""

    index: int
    text: str
    positions: list[Position]
    end: Delta | None
    prompt: list[PromptLogprob | None] = field(default_factory=list)
    """Prompt scores (None for position 0) when the choice's request scored its prompt."""
    token_ids: list[int] = field(default_factory=list)
    """Every generated id, a terminating stop token included (return_token_ids)."""

    @property
    def finish_reason(self) -> str | None:
        return self.end.finish_reason if self.end else None

    @property
    def stop_reason(self) -> str | int | None:
        return self.end.stop_reason if self.end else None


async def collect(
    jobs: list[ChoiceJob],
    engine: EngineClient,
    assets: ModelAssets,
    totals: Totals,
    prefixes: Mapping[int, str],
) -> list[ChoiceOutcome]:
    """Every choice run to its end, in job order; `prefixes` start a choice's text (echo)."""
    texts = {job.index: [prefixes.get(job.index, "")] for job in jobs}
    items: dict[int, list[Position]] = {job.index: [] for job in jobs}
    prompts: dict[int, list[PromptLogprob | None]] = {job.index: [] for job in jobs}
    ids: dict[int, list[int]] = {job.index: [] for job in jobs}
    ends: dict[int, Delta] = {}
    indices = [job.index for job in jobs]
    async for k, delta in merge(_streams(jobs, engine, assets)):
        index = indices[k]
        texts[index].append(delta.text)
        items[index].extend(delta.positions)
        prompts[index].extend(delta.prompt)
        ids[index].extend(delta.token_ids)
        totals.add(index, delta)
        if delta.finish_reason is not None:
            ends[index] = delta
    return [ChoiceOutcome(i, "".join(texts[i]), items[i], ends.get(i), prompts[i], ids[i])
            for i in indices]


async def stream_chunks(
    jobs: list[ChoiceJob],
    engine: EngineClient,
    assets: ModelAssets,
    *,
    id_prefix: str,
    obj: str,
    options: StreamOptions | None,
    totals: Totals,
    prompt_tokens: Mapping[int, int],
    choice: Callable[[int, str, Delta], dict[str, Any]],
    opening: Sequence[tuple[dict[str, Any], dict[str, Any]]] = (),
    prefixes: Mapping[int, str] | None = None,
    extra: Callable[[int, Delta], dict[str, Any]] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects: the `opening` (choice, top-level fields) pairs, then one per non-empty
    delta (its text led by the choice's prefix, once), then the usage chunk when asked for.
    `extra(index, delta)` adds top-level fields to a delta's chunk (chat's `prompt_logprobs`)."""
    head = envelope(id_prefix, obj, assets)
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    pending = dict(prefixes or {})

    def chunk(body: dict[str, Any], index: int, more: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        out = {**head, "choices": [body], **(more or {})}
        if continuous:
            prompt = prompt_tokens[index]
            done = totals.per_choice.get(index, 0)
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                            "total_tokens": prompt + done}
        return out

    for body, more in opening:
        yield chunk(body, body["index"], more)
    indices = [job.index for job in jobs]
    async for k, delta in merge(_streams(jobs, engine, assets)):
        index = indices[k]
        totals.add(index, delta)
        text = pending.pop(index, "") + delta.text
        if (not text and not delta.positions and not delta.prompt
                and delta.finish_reason is None):
            continue
        yield chunk(choice(index, text, delta), index,
                    extra(index, delta) if extra is not None else None)
    if include_usage:
        yield {**head, "choices": [], "usage": totals.usage()}
