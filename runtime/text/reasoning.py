"""Reasoning delimiters: which strings open and close a thinking span, as token ids.

A serving configuration names a parser (``reasoning_parser``: ``qwen3`` or ``deepseek_r1``,
both ``<think>`` / ``</think>``) and/or gives a dict ``reasoning_config`` with
``reasoning_start_str`` and ``reasoning_end_str``, which override the parser's strings (with
no parser, the dict must give both). The strings are tokenized with the model's tokenizer
(``tokenizer.json``), without special tokens; an end string of several tokens is forced
token by token when a request's ``thinking_token_budget`` is spent (ranks/commit.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
}
CONFIG_KEYS = ("reasoning_start_str", "reasoning_end_str")


@dataclass(frozen=True)
class ReasoningStrings:
    start: str
    end: str


@dataclass(frozen=True)
class ReasoningTokens:
    """The delimiters' token ids; what a request's thinking budget is enforced with."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    strings: ReasoningStrings | None = None


def reasoning_strings(parser: str | None, config: dict | None) -> ReasoningStrings | None:
    """The configured delimiters, or None when neither a parser nor a config is given.
    Raises ValueError for an unknown parser, unknown keys, or missing/empty strings."""
    if parser is None and config is None:
        return None
    if parser is not None and parser not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(PARSERS)}, got {parser!r}")
    start, end = PARSERS[parser] if parser is not None else (None, None)
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"reasoning_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"reasoning_config: unknown keys {unknown}; expected {CONFIG_KEYS}")
        start = config.get("reasoning_start_str", start)
        end = config.get("reasoning_end_str", end)
    for key, value in zip(CONFIG_KEYS, (start, end), strict=True):
        if not isinstance(value, str) or not value:
            raise ValueError(f"reasoning_config: {key} must be a non-empty string, "
                             f"got {value!r}")
    return ReasoningStrings(start, end)


def resolve_tokens(strings: ReasoningStrings, tokenizer) -> ReasoningTokens:
    """Token ids of both strings with a ``tokenizers.Tokenizer``."""

    def ids(text: str) -> tuple[int, ...]:
        encoded = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
        if not encoded:
            raise ValueError(f"reasoning string {text!r} encodes to no tokens")
        return encoded

    return ReasoningTokens(ids(strings.start), ids(strings.end), strings)


def load_reasoning(
    parser: str | None, config: dict | None, model_dir: str | Path
) -> ReasoningTokens | None:
    """The delimiters' ids with the model directory's tokenizer.json; None when unset."""
    strings = reasoning_strings(parser, config)
    if strings is None:
        return None
    import tokenizers

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"a reasoning configuration needs {path} to resolve its token ids")
    return resolve_tokens(strings, tokenizers.Tokenizer.from_file(str(path)))


def prompt_ends_reasoning(prompt_ids: Sequence[int], tokens: ReasoningTokens) -> bool:
    """The prompt closes a thinking span: its last end sequence comes after its last start
    sequence (vLLM's is_reasoning_end on the prompt, e.g. Qwen3's template with
    enable_thinking false ends the prompt with "<think>\\n\\n</think>\\n\\n"). The output is
    then all content."""
    ids = list(prompt_ids)
    end = _rfind(ids, tokens.end)
    return end >= 0 and end > _rfind(ids, tokens.start)


def count_reasoning_tokens(ids: Sequence[int], tokens: ReasoningTokens) -> int:
    """Generated tokens inside the thinking span (vLLM's
    usage.completion_tokens_details.reasoning_tokens); see ReasoningCounter."""
    counter = ReasoningCounter(tokens)
    counter.feed(ids)
    return counter.total()


class ReasoningCounter:
    """Counts a choice's reasoning tokens as they are generated, as ReasoningSplit splits the
    text: read left to right, an end sequence ends the span, a start sequence is skipped (the
    delimiters belong to neither part), any other token counts. It holds only the tokens it
    cannot place yet (fewer than the longer delimiter), never the output."""

    def __init__(self, tokens: ReasoningTokens) -> None:
        self.start, self.end = list(tokens.start), list(tokens.end)
        self.reach = max(len(self.start), len(self.end))
        self.pending: list[int] = []
        self.count = 0
        self.ended = False

    def feed(self, ids: Sequence[int]) -> None:
        if self.ended:
            return
        self.pending.extend(ids)
        placed, more, self.ended = self._place(self.pending, final=False)
        self.count += more
        del self.pending[:placed]
        if self.ended:
            self.pending.clear()

    def total(self) -> int:
        """The count if the output ended here (the held tokens placed; nothing changes)."""
        _, more, _ = self._place(self.pending, final=True)
        return self.count + more

    def _place(self, ids: list[int], *, final: bool) -> tuple[int, int, bool]:
        """(tokens placed, of which reasoning, whether an end sequence was met)."""
        i, count = 0, 0
        while i < len(ids):
            if not final and len(ids) - i < self.reach:
                break
            if ids[i : i + len(self.end)] == self.end:
                return i, count, True
            if ids[i : i + len(self.start)] == self.start:
                i += len(self.start)
            else:
                count += 1
                i += 1
        return i, count, False


def _rfind(ids: list[int], pattern: tuple[int, ...]) -> int:
    first, width = pattern[0], len(pattern)
    for i in range(len(ids) - width, -1, -1):
        if ids[i] == first and tuple(ids[i : i + width]) == pattern:
            return i
    return -1


class ReasoningSplit:
    """Generated text -> (reasoning, content), as vLLM's qwen3 and deepseek_r1 parsers split
    it: everything before the first end string is reasoning (start strings removed), the rest
    is content; the delimiters belong to neither. Fed piece by piece, it holds back a tail that
    could begin a delimiter, so the pieces join to the split of the whole text."""

    def __init__(self, strings: ReasoningStrings, *, ended: bool = False) -> None:
        """`ended`: the prompt closed the thinking span, so all output is content."""
        self.start, self.end = strings.start, strings.end
        self.held = ""
        """Text fed and not released yet (as fed)."""
        self.consumed = 0
        """Characters fed before `held`."""
        self.content_start: int | None = 0 if ended else None
        """Where the content begins in the fed text (None: no end string yet)."""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) released by `text`; `final` releases what is held."""
        self.held += text
        held, self.held = self.held, ""
        if self.content_start is not None:
            self.consumed += len(held)
            return "", held
        cut = held.find(self.end)
        if cut >= 0:
            self.content_start = self.consumed + cut + len(self.end)
            self.consumed += len(held)
            return held[:cut].replace(self.start, ""), held[cut + len(self.end):]
        keep = 0 if final else self._partial_delimiter(held)
        released, self.held = held[:len(held) - keep], held[len(held) - keep:]
        self.consumed += len(released)
        return released.replace(self.start, ""), ""

    def _partial_delimiter(self, text: str) -> int:
        """Length of the longest tail of `text` that begins a delimiter."""
        for n in range(min(len(text), max(len(self.start), len(self.end)) - 1), 0, -1):
            tail = text[-n:]
            if self.end.startswith(tail) or self.start.startswith(tail):
                return n
        return 0
