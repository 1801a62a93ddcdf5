"""What the engine sends out per request: its events and its error.

The engine's output message types, consumed by the text side (runtime/text/stops.py) and the
HTTP side (runtime/http/output/): ``PromptScores`` (when prompt scoring was asked for), then
``GeneratedToken`` in generated order, then exactly one ``Finished``; ``EngineError`` when a
request fails after admission. They live here, below both the engine and its consumers, so
that the text side needs no import of the engine: these are the typed outputs that cross from
the engine core to the API server processes (issue 35).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class EngineError(RuntimeError):
    """A request failed after admission (non-finite logprob, lost peer, ...)."""


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    """Exact FP32 value as a Python float; may be -inf, never NaN."""


class TokenLogprobs(Sequence[TokenLogprob]):
    """(id, logprob) pairs held as two parallel lists. A decoded frame hands each position
    the ids and values it read from the copied words, and the wire builders read the lists
    directly; a TokenLogprob tuple is made only when an item is read (16 lanes x 20
    alternatives would otherwise build 320 tuples per step that nobody reads). Equal to any
    sequence of the same (id, logprob) pairs."""

    __slots__ = ("ids", "values")

    def __init__(self, ids: list[int], values: list[float]) -> None:
        if len(ids) != len(values):
            raise ValueError(f"ids and values: {len(ids)} ids, {len(values)} values")
        self.ids = ids
        self.values = values

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, float]]) -> TokenLogprobs:
        if isinstance(pairs, TokenLogprobs):
            return pairs
        return cls([int(p[0]) for p in pairs], [float(p[1]) for p in pairs])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TokenLogprobs(self.ids[index], self.values[index])
        return TokenLogprob(self.ids[index], self.values[index])

    def __iter__(self) -> Iterator[TokenLogprob]:
        return map(TokenLogprob, self.ids, self.values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLogprobs):
            return self.ids == other.ids and self.values == other.values
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(zip(self.ids, self.values, strict=True))})"


@dataclass(frozen=True)
class GeneratedToken:
    index: int
    """Position in the generated sequence (0 = first generated token)."""
    token_id: int
    logprob: float | None
    """None when the request asked for no logprobs or the token was forced."""
    alternatives: Sequence[TokenLogprob] = ()
    """Natural top-N by (logprob desc, id asc), N = params.logprobs; or the selected ids in
    caller order when params.logprob_token_ids is set (a TokenLogprobs from the engine)."""
    last: bool | None = None
    """True: the request's Finished comes next (the finish rides on this token). False: the
    request cannot finish before another token (a later token of the same frame, or a request
    whose only finishes are emitted tokens: no stop token ids, EOS ignored). None: unknown, a
    stop token sampled next would finish it without a token."""
    entropy: float | None = None
    """The full-vocabulary entropy of the distribution the logprob was reported from (exact
    FP32 as a Python float), when the request asked for it (return_entropy); else None."""


@dataclass(frozen=True)
class PromptLogprob:
    position: int
    """Index of the scored token in the prompt (>= 1: position 0 has no context)."""
    token_id: int
    logprob: float
    """Exact FP32 value as a Python float; may be -inf, never NaN."""
    rank: int
    """1 + the number of vocabulary ids with a strictly greater logprob."""
    alternatives: tuple[TokenLogprob, ...] = ()
    """Natural top-N by (logprob desc, id asc), N = params.prompt_logprobs."""


@dataclass(frozen=True)
class PromptScores:
    """One scored chunk's prompt positions, in prompt order; every PromptScores of a request
    comes before its first GeneratedToken."""

    entries: tuple[PromptLogprob, ...]


@dataclass(frozen=True)
class Finished:
    reason: str
    """"stop" (EOS or a stop token id) or "length"."""
    stop_token_id: int | None = None
    """The terminating EOS / stop token: never yielded as a GeneratedToken, so it has no entry
    (except ``entry``)."""
    entry: GeneratedToken | None = None
    """A scoring request's (SamplingParams.stop_token_entry) terminating stop token with its
    logprob: reported as the last entry, its text left out as the stop token's always is."""
