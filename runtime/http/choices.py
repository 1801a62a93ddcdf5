"""What both endpoints do with their choices: the checks they open with, the response envelope,
the merged choices collected into whole outcomes or turned into streamed chunk objects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.engine.client import Engine, RequestError
from runtime.http.protocol import SamplingFields, StreamOptions
from runtime.http.serving import ChoiceJob, Delta, ModelAssets, Totals, merge, new_id, now, run_choice
from runtime.http.wire import Position, WireMode


def check_request(req: SamplingFields, unsupported: tuple[str, str] | None) -> None:
    if unsupported:
        raise RequestError(*unsupported)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options", "stream_options can only be set when stream=true")


def wire_mode(req: SamplingFields, enabled: bool) -> WireMode | None:
    """None: no logprobs requested."""
    if not enabled:
        return None
    return WireMode(req.logprob_token_ids is not None, bool(req.return_tokens_as_token_ids))


def envelope(id_prefix: str, obj: str, assets: ModelAssets) -> dict[str, Any]:
    return {"id": new_id(id_prefix), "object": obj, "created": now(),
            "model": assets.served_model_name}


def _streams(jobs: list[ChoiceJob], engine: Engine, assets: ModelAssets) -> list:
    return [run_choice(engine, job, assets.token_bytes) for job in jobs]


@dataclass
class Outcome:
    """One choice's whole output."""

    index: int
    text: str
    positions: list[Position]
    end: Delta | None

    @property
    def finish_reason(self) -> str | None:
        return self.end.finish_reason if self.end else None

    @property
    def stop_reason(self) -> str | int | None:
        return self.end.stop_reason if self.end else None


async def collect(
    jobs: list[ChoiceJob],
    engine: Engine,
    assets: ModelAssets,
    totals: Totals,
    prefixes: Mapping[int, str],
) -> list[Outcome]:
    """Every choice run to its end, in job order; `prefixes` start a choice's text (echo)."""
    texts = {job.index: [prefixes.get(job.index, "")] for job in jobs}
    items: dict[int, list[Position]] = {job.index: [] for job in jobs}
    ends: dict[int, Delta] = {}
    indices = [job.index for job in jobs]
    async for k, delta in merge(_streams(jobs, engine, assets)):
        index = indices[k]
        texts[index].append(delta.text)
        items[index].extend(delta.positions)
        totals.add(index, delta)
        if delta.finish_reason is not None:
            ends[index] = delta
    return [Outcome(i, "".join(texts[i]), items[i], ends.get(i)) for i in indices]


async def stream_chunks(
    jobs: list[ChoiceJob],
    engine: Engine,
    assets: ModelAssets,
    *,
    id_prefix: str,
    obj: str,
    options: StreamOptions | None,
    totals: Totals,
    prompt_tokens: Mapping[int, int],
    choice: Callable[[int, str, Delta], dict[str, Any]],
    opening: Sequence[dict[str, Any]] = (),
    prefixes: Mapping[int, str] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects: the `opening` choices, then one per non-empty delta (its text led by the
    choice's prefix, once), then the usage chunk when asked for."""
    head = envelope(id_prefix, obj, assets)
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    pending = dict(prefixes or {})

    def chunk(body: dict[str, Any], index: int) -> dict[str, Any]:
        out = {**head, "choices": [body]}
        if continuous:
            prompt = prompt_tokens[index]
            done = totals.per_choice.get(index, 0)
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                            "total_tokens": prompt + done}
        return out

    for body in opening:
        yield chunk(body, body["index"])
    indices = [job.index for job in jobs]
    async for k, delta in merge(_streams(jobs, engine, assets)):
        index = indices[k]
        totals.add(index, delta)
        text = pending.pop(index, "") + delta.text
        if not text and not delta.positions and delta.finish_reason is None:
            continue
        yield chunk(choice(index, text, delta), index)
    if include_usage:
        yield {**head, "choices": [], "usage": totals.usage()}
