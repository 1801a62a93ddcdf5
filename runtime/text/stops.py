"""Stop-string filtering that keeps logprob entries only for tokens before the stop.

`StopFilter` sits after the `Detokenizer`: it receives released text and the tokens whose
starts became final, holds back the longest tail that could still begin a stop string (at most
max stop length - 1 characters), and releases everything else together with the entries of
the tokens that start in the released text.

The first stop occurrence is the one that ends first (the one generation would meet first,
whatever the chunking); among those ending at the same character, the one starting earliest.
With include_stop_str_in_output=False the text is cut at its start, otherwise at its end. A
token keeps its entry iff it contributed text before the cut (its start offset < cut; a token
whose text is only partly returned keeps its entry and full bytes) or it is silent (no text,
between characters) and placed at or before the cut (offset <= cut), e.g. an EOS generated
under ignore_eos, which keeps its place in generation order. A token whose text starts at or
after the cut has no entry.

Terminating EOS and stop-token-id tokens are never yielded by the engine (Finished.stop_token_id)
and have no entry, except a scoring request's (Finished.entry, SamplingParams.stop_token_entry):
its text stays out of the output all the same, and its entry comes last, silent at the end of
the text (with include_stop_str_in_output, at the start of its text). Every queue holds only
what cannot be released yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from helios_logprobs.runtime.outputs import Finished, GeneratedToken
from helios_logprobs.runtime.text.detokenizer import Detokenizer, DetokStep, TokenStart
from helios_logprobs.runtime.text.token_bytes import TokenBytes

T = TypeVar("T")


@dataclass(frozen=True)
class Released(Generic[T]):
    text: str
    entries: tuple[tuple[T, int], ...]
    """(payload, character offset of the token's start in the full output text)."""
    stop: str | None = None
    """The stop string that ended the output in this step."""


def _keeps(start: TokenStart, cut: int) -> bool:
    return start.offset <= cut if start.silent else start.offset < cut


class StopFilter(Generic[T]):
    """Empty stop strings are ignored."""

    def __init__(
        self, stops: Sequence[str] = (), *, include_stop_str_in_output: bool = False
    ) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._include = include_stop_str_in_output
        self._prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._released = 0
        self._queue: deque[tuple[T, TokenStart]] = deque()
        self._stop: str | None = None
        self._finished = False

    @property
    def stop(self) -> str | None:
        return self._stop

    @property
    def done(self) -> bool:
        return self._finished or self._stop is not None

    @property
    def held_chars(self) -> int:
        return len(self._held)

    @property
    def released_chars(self) -> int:
        """Characters released so far: the offset of a silent token placed at the end."""
        return self._released

    @property
    def queued_entries(self) -> int:
        return len(self._queue)

    def push(self, text: str, starts: Iterable[tuple[T, TokenStart]] = (), *,
             match: bool = True) -> Released[T]:
        """``match=False``: do not look for stop strings (vLLM matches none before min_tokens
        tokens), but keep holding a tail that may begin one, so a stop string completed by a
        later, matched push is still found whole."""
        if self.done:
            raise RuntimeError("push() after the output ended")
        self._held += text
        self._queue.extend(starts)
        if not match:
            return self._release(len(self._held) - self._hold_length(), None)
        hit = self._first_stop()
        if hit is not None:
            begin, end, stop = hit
            cut = end if self._include else begin
            self._stop = stop
            return self._release(cut - self._released, stop)
        keep = self._hold_length()
        return self._release(len(self._held) - keep, None)

    def finish(self) -> Released[T]:
        """Release everything held (no stop string can complete any more)."""
        if self.done:
            return Released("", ())
        self._finished = True
        return self._release(len(self._held), None)

    def _release(self, count: int, stop: str | None) -> Released[T]:
        text, self._held = self._held[:count], self._held[count:]
        self._released += count
        cut = self._released
        entries = []
        while self._queue and (self._finished or _keeps(self._queue[0][1], cut)):
            payload, start = self._queue.popleft()
            entries.append((payload, start.offset))
        if stop is not None:
            self._held = ""
            self._queue.clear()
        return Released(text, tuple(entries), stop)

    def _first_stop(self) -> tuple[int, int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            found = self._held.find(stop)
            if found < 0:
                continue
            begin, end = self._released + found, self._released + found + len(stop)
            if best is None or (end, begin) < (best[1], best[0]):
                best = (begin, end, stop)
        return best

    def _hold_length(self) -> int:
        held = self._held
        for n in range(min(len(held), self._max_hold), 0, -1):
            if held[-n:] in self._prefixes:
                return n
        return 0


@dataclass(frozen=True)
class Chunk:
    text: str
    entries: tuple[tuple[GeneratedToken, int], ...]
    """Generated tokens with a logprob (forced tokens and requests without logprobs have none)
    whose text starts in this chunk, with their character offset in the generated text."""
    stop: str | None = None
    """Set when a stop string ended the output: the caller aborts generation."""


class OutputStream:
    """Engine output -> chunks: Detokenizer + StopFilter for one generated sequence.

    `prompt_ids` only decides whether generated text is at the start of the decoded text (see
    Detokenizer.after_prompt). Entries are released in generation order and never retained.
    """

    def __init__(
        self,
        token_bytes: TokenBytes,
        stops: Sequence[str] = (),
        *,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._min_tokens = min_tokens
        """Stop strings are matched only once more than this many tokens exist (vLLM)."""
        self._detok = Detokenizer.after_prompt(
            token_bytes, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._filter: StopFilter[GeneratedToken] = StopFilter(
            stops, include_stop_str_in_output=include_stop_str_in_output
        )
        self._include_stop_token = include_stop_str_in_output
        self._generated = 0
        self._pending: deque[GeneratedToken] = deque()

    @property
    def stop(self) -> str | None:
        return self._filter.stop

    @property
    def done(self) -> bool:
        return self._filter.done

    @property
    def retained(self) -> int:
        """Tokens and characters held anywhere in the stream (all bounded)."""
        return len(self._pending) + self._filter.queued_entries + self._filter.held_chars

    def push(self, token: GeneratedToken) -> Chunk:
        if self.done:
            raise RuntimeError("push() after the output ended")
        self._pending.append(token)
        self._generated += 1
        match = token.index >= self._min_tokens
        return self._chunk(self._detok.feed(token.token_id), final=False, match=match)

    def finish(self, finished: Finished | None = None) -> Chunk:
        """End of generation. The terminating stop token (finished.stop_token_id), if any, was
        never yielded and gets no entry unless the finish carries it (finished.entry, a
        scoring request); with include_stop_str_in_output its text still ends the output, as
        vLLM's detokenizer keeps it (a special token only when special tokens are not
        skipped), else the entry sits at the end of the text."""
        if self.done:
            return Chunk("", ())
        stop_token = None if finished is None else finished.stop_token_id
        entry = None if finished is None else finished.entry
        if stop_token is None or not self._include_stop_token:
            rest = self._chunk(self._detok.finish(), final=True)
            if entry is None or rest.stop is not None or entry.logprob is None:
                return rest
            return Chunk(rest.text, (*rest.entries, (entry, self._filter.released_chars)))
        self._pending.append(entry or GeneratedToken(self._generated, stop_token, logprob=None))
        fed = self._chunk(self._detok.feed(stop_token), final=False)
        if self.done:  # (its text completed a stop string)
            return fed
        rest = self._chunk(self._detok.finish(), final=True)
        return Chunk(fed.text + rest.text, fed.entries + rest.entries, rest.stop)

    def _chunk(self, step: DetokStep, *, final: bool, match: bool = True) -> Chunk:
        starts = [(self._pending.popleft(), start) for start in step.starts]
        released = self._filter.push(step.text, starts, match=match)
        if final and released.stop is None:
            tail = self._filter.finish()
            released = Released(released.text + tail.text, released.entries + tail.entries)
        if released.stop is not None:
            self._pending.clear()
        entries = tuple((tok, off) for tok, off in released.entries if tok.logprob is not None)
        return Chunk(released.text, entries, released.stop)
