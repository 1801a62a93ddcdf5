"""One choice's output parser: the reasoning split, then the tool-call parser on the content.

`feed(text, final)` takes the detokenizer's text as it is released and returns events in
output order; `consumed` is how far the generated text is classified (every event for the
text before it has been returned). `Attribution` queues a request's logprob positions until
the parser consumed their first character, then keeps those in a content source range.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from helios_logprobs.runtime.text.parsers.events import CONTENT, Event, Piece
from helios_logprobs.runtime.text.parsers.reasoning_parser import ReasoningParser
from helios_logprobs.runtime.text.parsers.tool_parsers import (
    TOOL_PARSERS,
    HeldToEnd,
    ToolParser,
    make_tool_call_id,
)
from helios_logprobs.runtime.text.reasoning import ReasoningStrings

FORCED = ("required", "named")


@dataclass(frozen=True)
class ParserSettings:
    """What a request's output is parsed with: reasoning delimiters (None: no reasoning
    split), whether the prompt already closed the thinking span, a tool parser's name (None:
    tool calls are not parsed: tool_choice none, or no tools)."""

    reasoning: ReasoningStrings | None = None
    reasoning_ended: bool = False
    tool_parser: str | None = None
    """A --tool-call-parser name, or FORCED ("required", "named": a constrained call)."""
    parallel_tool_calls: bool = True
    tool_name: str | None = None
    """The named function ("named")."""
    tool_parameters: dict[str, Any] | None = None
    """Each tool's parameters schema by name (qwen3_coder converts values by it)."""

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in (*TOOL_PARSERS, *FORCED):
            raise ValueError(f"tool_parser must be one of {sorted(TOOL_PARSERS)} or "
                             f"{FORCED}, got {self.tool_parser!r}")
        if (self.tool_parser == "named") != (self.tool_name is not None):
            raise ValueError("tool_name goes with tool_parser 'named', and only with it")

    def new_tool_parser(self, new_id: Callable[[], str]) -> ToolParser | None:
        kwargs: dict[str, Any] = {"parallel": self.parallel_tool_calls, "new_id": new_id}
        if self.tool_parser is None:
            return None
        if self.tool_parser in FORCED:
            return HeldToEnd(self.tool_name, **kwargs)
        if self.tool_parser == "qwen3_coder":
            kwargs["tools"] = self.tool_parameters
        return TOOL_PARSERS[self.tool_parser](**kwargs)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None


class OutputParser:
    def __init__(self, settings: ParserSettings,
                 new_id: Callable[[], str] = make_tool_call_id) -> None:
        self.reasoning = None if settings.reasoning is None else ReasoningParser(
            settings.reasoning, ended=settings.reasoning_ended)
        self.tools = settings.new_tool_parser(new_id)
        self.fed = 0
        self.done = False

    def feed(self, text: str, final: bool = False) -> list[Event]:
        if self.done:
            raise ValueError("the parser has seen its final text")
        at, self.fed, self.done = self.fed, self.fed + len(text), final
        pieces: list[Piece] = (self.reasoning.feed(text, final) if self.reasoning is not None
                               else [Piece(CONTENT, text, at)] if text else [])
        if self.tools is None:
            return list(pieces)
        out: list[Event] = []
        for piece in pieces:
            if piece.kind == CONTENT:
                out += self.tools.feed(piece.text, piece.start or 0)
            else:
                out.append(piece)
        if final:
            out += self.tools.feed("", self.fed, final=True)
        return out

    @property
    def consumed(self) -> int:
        """Characters of the generated text that every returned event accounts for."""
        held = [stage.pending_from for stage in (self.tools, self.reasoning)
                if stage is not None and stage.pending_from is not None]
        return min(held, default=self.fed)


class Attribution:
    """Logprob positions waiting for the parser: `add` them as they come, `note` the events,
    `release(consumed)` the ones whose first character is classified, kept only when it lies
    in a content source range (then in output order). It holds a position only until then,
    and the ranges that later positions may still fall in."""

    def __init__(self, has_text: Callable[[Any], bool] = lambda position: True) -> None:
        self.pending: deque = deque()
        self.ranges: deque[tuple[int, int]] = deque()
        self.has_text = has_text
        self.most_pending = 0
        """The largest number of positions held at once (what a test bounds)."""

    def add(self, positions: Iterable[Any]) -> None:
        self.pending.extend(positions)
        self.most_pending = max(self.most_pending, len(self.pending))

    def note(self, events: Iterable[Event]) -> None:
        for event in events:
            source = event.source if isinstance(event, Piece) else None
            if source is not None:
                self.ranges.append(source)

    def release(self, consumed: float) -> list[Any]:
        out = []
        while self.pending and self.pending[0].text_offset < consumed:
            position = self.pending.popleft()
            offset = position.text_offset
            while self.ranges and self.ranges[0][1] <= offset:
                self.ranges.popleft()
            if self.ranges and self.ranges[0][0] <= offset and self.has_text(position):
                out.append(position)
        while self.ranges and self.ranges[0][1] <= consumed and not self.pending:
            self.ranges.popleft()
        return out

    def finish(self) -> list[Any]:
        return self.release(float("inf"))
