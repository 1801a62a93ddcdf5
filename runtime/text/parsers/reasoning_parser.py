"""vLLM's qwen3 / deepseek_r1 reasoning split, incremental, with source ranges.

Everything before the first end string is reasoning (start strings removed: the start may
be in the prompt template, or generated), the rest is content; the delimiters belong to
neither. A prompt that closes the thinking span (`ended`) makes all output content. Fed piece
by piece, the parser holds back only a tail that could begin a delimiter, so the pieces join
to the split of the whole text.
"""

from __future__ import annotations

from helios_logprobs.runtime.text.parsers.events import CONTENT, REASONING, Piece
from helios_logprobs.runtime.text.reasoning import ReasoningStrings


def partial_tail(text: str, *delimiters: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a delimiter."""
    longest = max((len(d) for d in delimiters), default=1) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(d.startswith(tail) for d in delimiters):
            return n
    return 0


class ReasoningParser:
    def __init__(self, strings: ReasoningStrings, *, ended: bool = False) -> None:
        self.start, self.end = strings.start, strings.end
        self.held = ""
        self.held_at = 0
        """Offset of `held` in the generated text: everything before it is classified."""
        self.in_content = ended

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        at, buf, self.held = self.held_at, self.held + text, ""
        if self.in_content:
            self.held_at = at + len(buf)
            return [Piece(CONTENT, buf, at)] if buf else []
        cut = buf.find(self.end)
        if cut >= 0:
            out = self._reasoning(buf[:cut], at)
            self.in_content = True
            rest_at = at + cut + len(self.end)
            rest = buf[cut + len(self.end):]
            self.held_at = rest_at + len(rest)
            return [*out, Piece(CONTENT, rest, rest_at)] if rest else out
        keep = 0 if final else partial_tail(buf, self.start, self.end)
        released = buf[:len(buf) - keep]
        self.held, self.held_at = buf[len(released):], at + len(released)
        return self._reasoning(released, at)

    def _reasoning(self, text: str, at: int) -> list[Piece]:
        """`text` as reasoning pieces around its start strings (each piece its own range)."""
        pieces, pos = [], 0
        while True:
            found = text.find(self.start, pos)
            stop = len(text) if found < 0 else found
            if stop > pos:
                pieces.append(Piece(REASONING, text[pos:stop], at + pos))
            if found < 0:
                return pieces
            pos = found + len(self.start)

    @property
    def pending_from(self) -> int | None:
        """Where the held text begins, or None when nothing is held."""
        return self.held_at if self.held else None
