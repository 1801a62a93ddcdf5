"""What the decoder is told about each requesting slot, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from helios_logprobs.runtime.outputs import EngineError, TokenLogprobs


class DecodeError(EngineError):
    """The payload cannot back a request's entries: that request fails, others continue."""

    def __init__(self, slot: int, message: str) -> None:
        super().__init__(f"slot {slot}: {message}")
        self.slot = slot
        self.message = message


@dataclass(frozen=True)
class LaneExpectation:
    """What the scheduler expects of a requesting slot's record in this frame."""

    epoch: int
    ordinal: int
    logprobs: int | None = None
    """N natural alternatives (ignored when token_ids is set)."""
    token_ids: tuple[int, ...] | None = None
    """Selected IDs in caller order; their count is the slot's uploaded count."""
    pairs: int = field(init=False, compare=False, repr=False)
    """Alternative pairs this request reads from each position (a field: the decoder reads it
    for every lane of every frame)."""
    selected: list[int] | None = field(init=False, compare=False, repr=False)
    """token_ids as a list, which each position's ids are compared with."""

    def __post_init__(self) -> None:
        if self.logprobs is None and self.token_ids is None:
            raise ValueError("a requesting lane needs logprobs or token_ids")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: expected >= 0, got {self.logprobs}")
        if self.token_ids is not None and (
            not isinstance(self.token_ids, tuple) or not self.token_ids
        ):
            raise ValueError(f"token_ids: expected a non-empty tuple, got {self.token_ids!r}")
        pairs = len(self.token_ids) if self.token_ids is not None else int(self.logprobs)
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "selected", None if self.token_ids is None
                           else list(self.token_ids))

    def count(self, vocab_size: int) -> int:
        """Alternatives each entry reports: every selected ID, or N natural ones (at most the
        vocabulary)."""
        return self.pairs if self.token_ids is not None else min(self.pairs, vocab_size)


class DecodedEntry(NamedTuple):
    """(Named tuples here: a frame builds one per emitted position and one per slot, and a
    frozen dataclass costs about twice as much to construct.)"""

    position: int
    """Emitted position within this frame's record (the scheduler's generated order)."""
    token_id: int
    logprob: float
    """Exact FP32 value; -inf is preserved."""
    alternatives: TokenLogprobs
    """Natural (id, logprob) pairs trimmed to N, or every selected ID in caller order."""


class SlotDecode(NamedTuple):
    slot: int
    entries: tuple[DecodedEntry, ...]
    """Entries before the first failure, in generated order."""
    error: DecodeError | None = None
    """Set when the request fails; its later tokens in this frame produce no entries."""

    @property
    def ok(self) -> bool:
        return self.error is None


class LaneRows(NamedTuple):
    """One requesting slot's rows of a FrameDecode: ``start:stop`` in emitted order, the
    entries ``start:good`` (good < stop: the row ``good`` fails, ``error`` names it; a record
    that fails its checks has no rows and its error)."""

    start: int
    stop: int
    good: int
    error: DecodeError | None = None
