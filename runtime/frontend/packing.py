"""A step's engine events <-> StepOutputs arrays: ``StepPacker`` collects one API server's
events on the engine core, ``unpack`` turns a StepOutputs back into each request's events on
the API server, equal to what the engine delivered."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from helios_logprobs.runtime.frontend.messages import CoreStats, Ended, PromptRows, StepOutputs
from helios_logprobs.runtime.outputs import (
    EngineError,
    Finished,
    GeneratedToken,
    PromptLogprob,
    PromptScores,
    TokenLogprob,
    TokenLogprobs,
)

_LAST = {None: -1, False: 0, True: 1}
_LAST_OF = (False, True, None)  # indexed by the int8 value (-1 -> None)
Event = PromptScores | GeneratedToken | Finished | EngineError


def _alternatives(alternatives) -> TokenLogprobs:
    return TokenLogprobs.of(alternatives)


class StepPacker:
    """One API server's events since the last ``take``, kept as flat lists."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.request_ids: list[int] = []
        self.indexes: list[int] = []
        self.token_ids: list[int] = []
        self.values: list[float] = []
        self.last: list[int] = []
        self.alt_counts: list[int] = []
        self.alt_ids: list[int] = []
        self.alt_values: list[float] = []
        self.prompts: list[PromptRows] = []
        self.ends: list[Ended] = []

    def __bool__(self) -> bool:
        return bool(self.request_ids or self.prompts or self.ends)

    def add(self, request_id: int, event: Event) -> None:
        if isinstance(event, GeneratedToken):
            self.request_ids.append(request_id)
            self.indexes.append(event.index)
            self.token_ids.append(event.token_id)
            self.values.append(np.nan if event.logprob is None else event.logprob)
            self.last.append(_LAST[event.last])
            alternatives = _alternatives(event.alternatives)
            self.alt_counts.append(len(alternatives))
            self.alt_ids.extend(alternatives.ids)
            self.alt_values.extend(alternatives.values)
        elif isinstance(event, Finished):
            entry = None
            if event.entry is not None:
                e = event.entry
                alternatives = _alternatives(e.alternatives)
                entry = (e.index, e.token_id, e.logprob, tuple(alternatives.ids),
                         tuple(alternatives.values), _LAST[e.last])
            self.ends.append(Ended(request_id, event.reason, event.stop_token_id, entry))
        elif isinstance(event, EngineError):
            self.ends.append(Ended(request_id, "", error=str(event)))
        elif isinstance(event, PromptScores):
            self.prompts.append(_prompt_rows(request_id, event))
        else:
            raise TypeError(f"not an engine event: {type(event).__name__}")

    def take(self, stats: CoreStats) -> StepOutputs:
        out = StepOutputs(
            np.array(self.request_ids, dtype=np.int64), np.array(self.indexes, dtype=np.int32),
            np.array(self.token_ids, dtype=np.int32), np.array(self.values, dtype=np.float32),
            np.array(self.last, dtype=np.int8), np.array(self.alt_counts, dtype=np.int32),
            np.array(self.alt_ids, dtype=np.int32), np.array(self.alt_values, dtype=np.float32),
            tuple(self.prompts), tuple(self.ends), stats,
        )
        self._reset()
        return out


def _prompt_rows(request_id: int, scores: PromptScores) -> PromptRows:
    entries = scores.entries
    ids: list[int] = []
    values: list[float] = []
    for entry in entries:
        alternatives = _alternatives(entry.alternatives)
        ids.extend(alternatives.ids)
        values.extend(alternatives.values)
    return PromptRows(
        request_id,
        np.array([e.position for e in entries], dtype=np.int64),
        np.array([e.token_id for e in entries], dtype=np.int32),
        np.array([e.logprob for e in entries], dtype=np.float32),
        np.array([e.rank for e in entries], dtype=np.int64),
        np.array([len(e.alternatives) for e in entries], dtype=np.int32),
        np.array(ids, dtype=np.int32), np.array(values, dtype=np.float32),
    )


def _unpack_prompt(rows: PromptRows) -> PromptScores:
    ids, values = rows.alt_ids.tolist(), rows.alt_values.tolist()
    entries = []
    start = 0
    for position, token_id, value, rank, count in zip(
            rows.positions.tolist(), rows.token_ids.tolist(), rows.values.tolist(),
            rows.ranks.tolist(), rows.alt_counts.tolist(), strict=True):
        alternatives = tuple(map(TokenLogprob, ids[start:start + count],
                                 values[start:start + count]))
        start += count
        entries.append(PromptLogprob(position, token_id, value, rank, alternatives))
    return PromptScores(tuple(entries))


def unpack(outputs: StepOutputs) -> Iterator[tuple[int, Event]]:
    """(request id, event) in the order a request's events were delivered: prompt scores,
    then tokens, then its end."""
    for rows in outputs.prompts:
        yield rows.request_id, _unpack_prompt(rows)
    ids, values = outputs.alt_ids.tolist(), outputs.alt_values.tolist()
    start = 0
    for request_id, index, token_id, value, last, count in zip(
            outputs.request_ids.tolist(), outputs.indexes.tolist(),
            outputs.token_ids.tolist(), outputs.values.tolist(), outputs.last.tolist(),
            outputs.alt_counts.tolist(), strict=True):
        end = start + count
        alternatives = TokenLogprobs(ids[start:end], values[start:end])
        start = end
        logprob = None if value != value else value  # NaN: no logprob
        yield request_id, GeneratedToken(index, token_id, logprob, alternatives, _LAST_OF[last])
    for ended in outputs.ends:
        yield ended.request_id, _unpack_end(ended)


def _unpack_end(ended: Ended) -> Finished | EngineError:
    if ended.error is not None:
        return EngineError(ended.error)
    entry = None
    if ended.entry is not None:
        index, token_id, logprob, alt_ids, alt_values, last = ended.entry
        entry = GeneratedToken(index, token_id, logprob,
                               TokenLogprobs(list(alt_ids), list(alt_values)), _LAST_OF[last])
    return Finished(ended.reason, ended.stop_token_id, entry)
