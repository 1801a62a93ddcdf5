"""What the output parsers emit, and the source ranges that attribute tokens to content.

Offsets count characters of the generated text (a request's output, as the detokenizer
releases it: the same offsets as a token's `text_offset`). A token's first text byte lies in
the character at its offset, so "the token's first byte is in a content range" is
"start <= text_offset < end" for a content piece's [start, end).
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING = "reasoning"
CONTENT = "content"
KINDS = (REASONING, CONTENT)


@dataclass(frozen=True)
class Piece:
    """Text of one kind. `start`: where the text lies in the generated text (it is exactly
    the source's characters [start, start + len(text))); None: synthesized, no source."""

    kind: str
    text: str
    start: int | None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.start is not None and self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")

    @property
    def end(self) -> int | None:
        return None if self.start is None else self.start + len(self.text)

    @property
    def source(self) -> tuple[int, int] | None:
        """The content source range [start, end) (None: reasoning or synthesized)."""
        if self.kind != CONTENT or self.start is None or not self.text:
            return None
        return self.start, self.start + len(self.text)


@dataclass(frozen=True)
class ToolCall:
    """One whole tool call (vLLM's shape): `arguments` is JSON text. Its text is tool data:
    it has no content source range. `index` counts the choice's calls from 0."""

    index: int
    id: str
    name: str
    arguments: str


Event = Piece | ToolCall


def joined(events: list[Event], kind: str) -> str:
    return "".join(e.text for e in events if isinstance(e, Piece) and e.kind == kind)
