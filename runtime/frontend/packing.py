"""A step's engine events <-> StepOutputs arrays: ``StepPacker`` collects one API server's
events on the engine core, ``unpack`` turns a StepOutputs back into each request's events on
the API server, equal to what the engine delivered."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from helios_logprobs.runtime.engine.frame_tokens import (
    LAST_CODES,
    FrameTokens,
    TokenColumns,
    concat_columns,
)
from helios_logprobs.runtime.engine.prompt_reader import PromptArrays
from helios_logprobs.runtime.frontend.messages import CoreStats, Ended, PromptRows, StepOutputs
from helios_logprobs.runtime.outputs import (
    EngineError,
    Finished,
    GeneratedToken,
    PromptScores,
    TokenLogprobs,
)

Event = PromptScores | GeneratedToken | Finished | EngineError


class StepPacker:
    """One API server's outputs since the last ``take``: token rows as (frame, row range)
    references until ``take`` gathers them, prompt rows and ends."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._frame: FrameTokens | None = None
        self._request_ids: list[int] = []
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._contiguous = True
        """The rows since the frame began are one run (an API server that takes every request
        of the frame in order: no gather)."""
        self._chunks: list[tuple[np.ndarray, TokenColumns]] = []
        self.prompts: list[PromptRows] = []
        self.ends: list[Ended] = []

    def __bool__(self) -> bool:
        return bool(self._request_ids or self._chunks or self.prompts or self.ends)

    def add_rows(self, request_id: int, frame: FrameTokens, start: int, stop: int) -> None:
        """A request's token rows ``start:stop`` of ``frame`` (kept by reference)."""
        if frame is not self._frame:
            self._close_frame()
            self._frame = frame
        elif self._stops[-1] != start:
            self._contiguous = False
        self._request_ids.append(request_id)
        self._starts.append(start)
        self._stops.append(stop)

    def add_prompt(self, request_id: int, scores: PromptArrays) -> None:
        self.prompts.append(PromptRows(request_id, *scores))

    def add(self, request_id: int, event: Finished | EngineError) -> None:
        if isinstance(event, Finished):
            entry = None
            if event.entry is not None:
                e = event.entry
                alternatives = TokenLogprobs.of(e.alternatives)
                entry = (e.index, e.token_id, e.logprob, tuple(alternatives.ids),
                         tuple(alternatives.values), LAST_CODES[e.last], e.entropy)
            self.ends.append(Ended(request_id, event.reason, event.stop_token_id, entry))
        elif isinstance(event, EngineError):
            self.ends.append(Ended(request_id, "", error=str(event)))
        else:
            raise TypeError(f"not an engine event: {type(event).__name__}")

    def _close_frame(self) -> None:
        if self._request_ids:
            lengths = np.subtract(self._stops, self._starts)
            request_ids = np.repeat(np.array(self._request_ids, dtype=np.int64), lengths)
            columns = (self._frame.rows(self._starts[0], self._stops[-1]) if self._contiguous
                       else self._frame.select(self._starts, self._stops))
            self._chunks.append((request_ids, columns))
            self._request_ids, self._starts, self._stops = [], [], []
        self._frame = None
        self._contiguous = True

    def take(self, stats: CoreStats) -> StepOutputs:
        self._close_frame()
        if len(self._chunks) == 1:
            request_ids, columns = self._chunks[0]
        elif self._chunks:
            request_ids = np.concatenate([ids for ids, _ in self._chunks])
            columns = concat_columns([c for _, c in self._chunks])
        else:
            request_ids, columns = np.zeros(0, dtype=np.int64), _NO_TOKENS
        out = StepOutputs(request_ids, *columns[:7], tuple(self.prompts), tuple(self.ends),
                          stats, entropy=columns.entropy)
        self._reset()
        return out


_NO_TOKENS = TokenColumns(
    np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32),
    np.zeros(0, np.int8), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))


def _unpack_prompt(rows: PromptRows) -> PromptScores:
    return PromptScores(PromptArrays(rows.positions, rows.token_ids, rows.values, rows.ranks,
                                     rows.alt_counts, rows.alt_ids, rows.alt_values).entries())


def unpack(outputs: StepOutputs) -> Iterator[tuple[int, Event]]:
    """(request id, event) in the order a request's events were delivered: prompt scores,
    then tokens, then its end."""
    for rows in outputs.prompts:
        yield rows.request_id, _unpack_prompt(rows)
    tokens = TokenColumns(outputs.indexes, outputs.token_ids, outputs.values, outputs.last,
                          outputs.alt_counts, outputs.alt_ids, outputs.alt_values,
                          outputs.entropy).tokens()
    yield from zip(outputs.request_ids.tolist(), tokens, strict=True)
    for ended in outputs.ends:
        yield ended.request_id, _unpack_end(ended)


def _unpack_end(ended: Ended) -> Finished | EngineError:
    if ended.error is not None:
        return EngineError(ended.error)
    entry = None
    if ended.entry is not None:
        index, token_id, logprob, alt_ids, alt_values, last, *entropy = ended.entry
        entry = GeneratedToken(index, token_id, logprob,
                               TokenLogprobs(list(alt_ids), list(alt_values)),
                               None if last < 0 else bool(last), *entropy)
    return Finished(ended.reason, ended.stop_token_id, entry)
