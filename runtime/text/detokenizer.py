"""Incremental detokenizer: token ids in, stable text and token start offsets out.

Text is built from `TokenBytes` with an incremental UTF-8 decoder (`Utf8Stream`, equivalent to
errors="replace" on the whole byte stream), so a character split over several tokens is
released only once complete (or once it is known to be invalid), and memory stays
O(pending bytes + unreleased tokens): no decoder prefixes are kept.

Token offsets count characters of this detokenizer's output text:

* a token with bytes starts at the character that contains its first byte (a token that
  completes a character begun by an earlier token starts at that character);
* a token without bytes (a skipped special token, an empty piece) while a character is
  incomplete is attributed to that character, like the bytes around it;
* otherwise a token adding no text (no bytes, or bytes all removed by the leading Strip) is
  silent: it sits between characters, at the number of characters before it. A stop string
  beginning at that offset comes after it.

Offsets are non-decreasing in fed order.

A token's offset is provisional until the character holding its start is released; it is
reported (final) in the step that releases that character, so a streamed chunk carries exactly
the tokens whose text starts in it. `finish()` turns trailing partial bytes into U+FFFD and
reports the rest.

Text equals `tokenizer.decode(ids, skip_special_tokens=True)` (at_start=True), with one
intended difference: an invalid byte sequence is replaced per maximal subpart (Unicode's
recommended practice, as `String::from_utf8_lossy`, Python, and the ByteLevel decoder do),
whereas tokenizers' ByteFallback decoder turns every byte of a run of `<0xNN>` tokens into its
own U+FFFD as soon as the run holds any invalid byte. Emulating that would mean holding back
every run of byte tokens until it ends, which is unbounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from helios_logprobs.runtime.text.token_bytes import TokenBytes


@dataclass(frozen=True)
class TokenStart:
    index: int
    """Position of the token in the fed sequence (0 = first fed token)."""
    offset: int
    """Character offset of the token's start in this detokenizer's full output text."""
    silent: bool
    """The token adds no text and lies between characters (see the module docstring)."""


@dataclass(frozen=True)
class DetokStep:
    text: str
    """Newly released text."""
    starts: tuple[TokenStart, ...]
    """Tokens whose start became final in this step, in fed order."""


def _lead(byte: int) -> tuple[int, int, int]:
    """(continuation bytes needed, allowed range of the first continuation) for a lead byte;
    needed = -1 for a byte that cannot start a character."""
    if byte < 0x80:
        return 0, 0, 0
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
    if 0xF0 <= byte <= 0xF4:
        return 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
    return -1, 0, 0


def _continues(pending: bytes, byte: int) -> bool:
    """Whether `byte` extends `pending`, a valid but incomplete UTF-8 sequence."""
    if len(pending) > 1:
        return 0x80 <= byte <= 0xBF
    _, low, high = _lead(pending[0])
    return low <= byte <= high


class Utf8Stream:
    """Incremental UTF-8 decoding with U+FFFD per maximal invalid subpart.

    Same output as bytes.decode("utf-8", "replace") on the whole stream. Unlike Python's
    incremental decoder, which keeps a surrogate prefix such as ED A0 pending although it is
    already invalid, the pending bytes here are always a valid incomplete prefix.
    """

    def __init__(self) -> None:
        self.pending = b""

    def decode(self, data: bytes, final: bool = False) -> str:
        if not self.pending:
            try:
                return data.decode()
            except UnicodeDecodeError:
                pass
        buf, out, i = self.pending + data, [], 0
        while i < len(buf):
            need, low, high = _lead(buf[i])
            if need <= 0:
                out.append(chr(buf[i]) if need == 0 else "\ufffd")
                i += 1
                continue
            j = i + 1
            while j < len(buf) and j - i <= need:
                if not (low if j == i + 1 else 0x80) <= buf[j] <= (high if j == i + 1 else 0xBF):
                    break
                j += 1
            if j - i == need + 1:
                out.append(buf[i:j].decode())
            elif j == len(buf) and not final:
                break
            else:
                out.append("\ufffd")
            i = j
        self.pending = buf[i:]
        return "".join(out)


class Detokenizer:
    """Feed ids one at a time; `at_start=False` continues text after a prompt.

    `at_start=True` applies the decoder's start-of-text cleanup (Strip's leading space, the
    Metaspace first-token rule); use it when nothing was decoded before (see `after_prompt`).
    """

    def __init__(
        self,
        token_bytes: TokenBytes,
        *,
        skip_special_tokens: bool = True,
        at_start: bool = True,
    ) -> None:
        self._tb = token_bytes
        self._skip = skip_special_tokens
        self._utf8 = Utf8Stream()
        strip = token_bytes.strip if at_start else None
        self._strip_char, self._strip_left = strip if strip else (" ", 0)
        self._first = at_start and token_bytes.plan.first_token_drop is not None
        self._fed = 0
        self._bytes = 0
        self._raw = 0
        self._stripped = 0
        self._stripped_bytes = 0
        self._chars = 0
        self._placed: deque[tuple[int, int, bool, int]] = deque()
        self._finished = False

    @classmethod
    def after_prompt(
        cls, token_bytes: TokenBytes, prompt_ids: Iterable[int], *, skip_special_tokens: bool = True
    ) -> Detokenizer:
        """A detokenizer for generated text: at the start only if the prompt decodes to nothing
        (empty or only skipped special tokens). Trailing partial UTF-8 of the prompt is not
        carried over: the prompt/generation boundary is treated as a character boundary."""
        at_start = all(skip_special_tokens and token_bytes.is_special(t) for t in prompt_ids)
        return cls(token_bytes, skip_special_tokens=skip_special_tokens, at_start=at_start)

    @property
    def text_length(self) -> int:
        """Characters released so far."""
        return self._chars

    @property
    def tokens_fed(self) -> int:
        return self._fed

    @property
    def unreleased_tokens(self) -> int:
        """Tokens whose start is not final yet (bounded by the pending character)."""
        return len(self._placed)

    def _data(self, token_id: int) -> bytes:
        if self._skip and self._tb.is_special(token_id):
            return b""
        if self._first:
            self._first = False
            return self._tb.first_bytes_of(token_id)
        return self._tb.bytes_of(token_id)

    def feed(self, token_id: int) -> DetokStep:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        index = self._fed
        data = self._data(token_id)
        self._fed += 1
        pending = self._utf8.pending
        if not data:
            start = self._raw
        else:
            start = self._raw + (1 if pending and not _continues(pending, data[0]) else 0)
        self._bytes += len(data)
        self._placed.append((index, start, not (data or pending), self._bytes))
        text = self._release_chars(self._utf8.decode(data))
        return DetokStep(text, self._release_tokens(final=False))

    def finish(self) -> DetokStep:
        """Flush: trailing partial bytes become U+FFFD; every remaining start is final."""
        if self._finished:
            return DetokStep("", ())
        self._finished = True
        text = self._release_chars(self._utf8.decode(b"", final=True))
        return DetokStep(text, self._release_tokens(final=True))

    def _release_chars(self, raw: str) -> str:
        self._raw += len(raw)
        cut = 0
        if self._strip_left and raw:
            while cut < len(raw) and cut < self._strip_left and raw[cut] == self._strip_char:
                cut += 1
            self._strip_left = 0 if cut < len(raw) else self._strip_left - cut
            self._stripped += cut
            self._stripped_bytes += cut * len(self._strip_char.encode())
        text = raw[cut:]
        self._chars += len(text)
        return text

    def _release_tokens(self, *, final: bool) -> tuple[TokenStart, ...]:
        out = []
        placed = self._placed
        while placed:
            index, start, silent, end = placed[0]
            if not final and (start > self._raw if silent else start >= self._raw):
                break
            placed.popleft()
            silent = silent or end <= self._stripped_bytes
            out.append(TokenStart(index, start - min(start, self._stripped), silent))
        return tuple(out)


def detokenize(
    token_bytes: TokenBytes, ids: Iterable[int], **kwargs: bool
) -> tuple[str, list[int]]:
    """Whole-sequence helper: (text, start offset of every token)."""
    det = Detokenizer(token_bytes, **kwargs)
    parts: list[str] = []
    offsets: list[int] = []
    for token_id in ids:
        step = det.feed(token_id)
        parts.append(step.text)
        offsets.extend(s.offset for s in step.starts)
    step = det.finish()
    parts.append(step.text)
    offsets.extend(s.offset for s in step.starts)
    return "".join(parts), offsets
