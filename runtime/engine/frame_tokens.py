"""One frame's emitted tokens as parallel arrays (what the engine core sends per step), and the
one way back to GeneratedToken objects (the API server's side, or an in-process consumer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from helios_logprobs.runtime.outputs import GeneratedToken, TokenLogprobs

LAST_CODES = {None: -1, False: 0, True: 1}
"""GeneratedToken.last as an int8 (the ``last`` column)."""
_LAST_OF = (False, True, None)  # indexed by the int8 code (-1 -> None)


class TokenColumns(NamedTuple):
    """Tokens as parallel columns, alternatives flattened in row order (``alt_counts``)."""

    indexes: np.ndarray
    """int32: position in the request's generated sequence."""
    token_ids: np.ndarray
    """int32."""
    values: np.ndarray
    """float32, exact FP32; NaN: no logprob (a real value never is NaN)."""
    last: np.ndarray
    """int8: LAST_CODES."""
    alt_counts: np.ndarray
    """int32."""
    alt_ids: np.ndarray
    """int32."""
    alt_values: np.ndarray
    """float32, exact FP32."""
    entropy: np.ndarray | None = None
    """float32 per token, exact FP32; NaN: none. None: no token of these rows has one."""

    def tokens(self) -> list[GeneratedToken]:
        """The columns as GeneratedToken objects (Python floats hold FP32 values exactly)."""
        ids, values = self.alt_ids.tolist(), self.alt_values.tolist()
        n = len(self.indexes)
        entropies = [None] * n if self.entropy is None else [
            None if h != h else h for h in self.entropy.tolist()]
        tokens = []
        start = 0
        for index, token_id, value, last, count, entropy in zip(
                self.indexes.tolist(), self.token_ids.tolist(), self.values.tolist(),
                self.last.tolist(), self.alt_counts.tolist(), entropies, strict=True):
            end = start + count
            tokens.append(GeneratedToken(
                index, token_id, None if value != value else value,
                TokenLogprobs(ids[start:end], values[start:end]), _LAST_OF[last], entropy))
            start = end
        return tokens


def concat_columns(parts: Sequence[TokenColumns]) -> TokenColumns:
    """The columns of ``parts`` one after another (entropy NaN for a part without it)."""
    arrays = [np.concatenate(column) for column in zip(*(p[:7] for p in parts), strict=True)]
    entropy = None
    if any(p.entropy is not None for p in parts):
        entropy = np.concatenate([
            p.entropy if p.entropy is not None else np.full(len(p.indexes), np.nan, np.float32)
            for p in parts])
    return TokenColumns(*arrays, entropy)


@dataclass(frozen=True)
class FrameTokens:
    """Every token a frame emitted for its sampling requests, each request's rows contiguous
    and in emitted order; row r's alternatives are ``alt_ids[alt_offsets[r]:alt_offsets[r+1]]``
    (rows and their alternatives in one order: a run of rows is a run of alternatives)."""

    indexes: np.ndarray
    token_ids: np.ndarray
    values: np.ndarray
    last: np.ndarray
    alt_counts: np.ndarray
    alt_offsets: np.ndarray
    """int64 [rows + 1]: 0, then the running sum of alt_counts."""
    alt_ids: np.ndarray
    alt_values: np.ndarray
    entropy: np.ndarray | None = None
    """float32 [rows]: each row's entropy (NaN: none); None when no row has one."""

    def __post_init__(self) -> None:
        n = len(self.indexes)
        if self.entropy is not None and len(self.entropy) != n:
            raise ValueError(f"entropy: {len(self.entropy)} rows, expected {n}")
        for name in ("token_ids", "values", "last", "alt_counts"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: {len(getattr(self, name))} rows, expected {n}")
        if len(self.alt_offsets) != n + 1 or len(self.alt_ids) != len(self.alt_values) \
                or self.alt_offsets[-1] != len(self.alt_ids):
            raise ValueError("alt_offsets, alt_ids and alt_values do not match alt_counts")

    def rows(self, start: int, stop: int) -> TokenColumns:
        """Rows ``start:stop`` (views)."""
        a, b = self.alt_offsets[start], self.alt_offsets[stop]
        return TokenColumns(self.indexes[start:stop], self.token_ids[start:stop],
                            self.values[start:stop], self.last[start:stop],
                            self.alt_counts[start:stop], self.alt_ids[a:b], self.alt_values[a:b],
                            None if self.entropy is None else self.entropy[start:stop])

    def select(self, starts: Sequence[int], stops: Sequence[int]) -> TokenColumns:
        """The rows ``starts[i]:stops[i]`` in that order."""
        starts_array = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(stops, dtype=np.int64) - starts_array
        rows = _ranges(starts_array, lengths)
        counts = self.alt_counts[rows]
        alt_rows = _ranges(self.alt_offsets[rows], counts.astype(np.int64))
        return TokenColumns(self.indexes[rows], self.token_ids[rows], self.values[rows],
                            self.last[rows], counts, self.alt_ids[alt_rows],
                            self.alt_values[alt_rows],
                            None if self.entropy is None else self.entropy[rows])

    def tokens(self, start: int, stop: int) -> list[GeneratedToken]:
        return self.rows(start, stop).tokens()

    @classmethod
    def of(cls, tokens: Sequence[GeneratedToken]) -> FrameTokens:
        """Objects -> arrays (tests, and an engine event built outside a frame)."""
        counts = [len(t.alternatives) for t in tokens]
        alternatives = [TokenLogprobs.of(t.alternatives) for t in tokens]
        entropy = None
        if any(t.entropy is not None for t in tokens):
            entropy = np.array([np.nan if t.entropy is None else t.entropy for t in tokens],
                               dtype=np.float32)
        return cls(
            np.array([t.index for t in tokens], dtype=np.int32),
            np.array([t.token_id for t in tokens], dtype=np.int32),
            np.array([np.nan if t.logprob is None else t.logprob for t in tokens],
                     dtype=np.float32),
            np.array([LAST_CODES[t.last] for t in tokens], dtype=np.int8),
            np.array(counts, dtype=np.int32),
            np.cumsum([0, *counts], dtype=np.int64),
            np.array([i for a in alternatives for i in a.ids], dtype=np.int32),
            np.array([v for a in alternatives for v in a.values], dtype=np.float32),
            entropy,
        )


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[0]..starts[0]+lengths[0]-1, starts[1].., as one int64 array."""
    total = int(lengths.sum())
    if len(lengths) == 1:
        return np.arange(starts[0], starts[0] + total)
    return np.arange(total) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
