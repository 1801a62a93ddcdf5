"""Token id -> the true bytes of its text, following the tokenizer's decoder.

A token's bytes are what the decoder makes of that one vocabulary piece (or added token's
content; `tokenizers` sends added and special tokens through the decoder too) before UTF-8
replacement and before stream-boundary cleanup:

* ByteLevel: each piece character maps back through the GPT-2 byte map; a piece with any
  character outside the map is taken as its own UTF-8 (as the decoder does).
* Replace + ByteFallback (+ Fuse + Strip), as in Llama/Mistral: string replacements ("▁" ->
  " ") first, then a `<0xNN>` piece is the single byte NN, any other piece its UTF-8.
* Metaspace: the replacement character becomes a space.

Stream-boundary cleanup is not part of a token's bytes: `Strip` (after `Fuse`) removes leading
spaces from the start of the whole decoded text, and the Metaspace decoder removes every
replacement character of the first decoded token. `strip` and `first_bytes_of` describe those,
and the incremental detokenizer applies them. Hence, for ids whose byte-fallback runs are valid
UTF-8, `tokenizer.decode(ids)` equals the UTF-8 (errors="replace") of the concatenated bytes
(first token through `first_bytes_of`, skipped special tokens left out) with `strip` applied.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import tokenizers

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"
MAX_CONTEXT = 4
"""Context tokens vLLM decodes a partial token after (a UTF-8 character has at most 4 bytes)."""


class UnsupportedDecoder(ValueError):
    """The tokenizer's decoder cannot be expressed as per-token bytes plus stream cleanup."""


def _ends_unfinished(data: bytes) -> bool:
    """The bytes after the leading continuation bytes (0x80-0xBF) decode to a text ending in
    U+FFFD (then so does the token after any bytes)."""
    lead = 0
    while lead < len(data) and 0x80 <= data[lead] <= 0xBF:
        lead += 1
    return lead < len(data) and data[lead:].decode("utf-8", "replace").endswith(REPLACEMENT)


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode map: printable character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


@dataclass(frozen=True)
class DecoderPlan:
    """What a supported `tokenizers` decoder does, split into per-token and stream parts."""

    replaces: tuple[tuple[str, str], ...] = ()
    byte_fallback: bool = False
    byte_level: bool = False
    strip: tuple[str, int] | None = None
    """Stream-level Strip: (character, how many leading ones the decoded text loses)."""
    first_token_drop: str | None = None
    """Metaspace: the first decoded token loses every occurrence of this character."""

    def piece_bytes(self, piece: str, *, first: bool = False) -> bytes:
        if self.byte_level:
            table = gpt2_byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if first and self.first_token_drop:
            piece = piece.replace(self.first_token_drop, "")
        for old, new in self.replaces:
            piece = piece.replace(old, new)
        if self.byte_fallback:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return piece.encode()


def plan_decoder(config: dict[str, Any] | None) -> DecoderPlan:
    """Interpret a decoder's JSON (as in tokenizer.json); raise UnsupportedDecoder otherwise."""
    if config is None:
        raise UnsupportedDecoder("tokenizer has no decoder")
    kind = config.get("type")
    if kind == "ByteLevel":
        return DecoderPlan(byte_level=True)
    if kind == "Metaspace":
        return _metaspace(config)
    if kind != "Sequence":
        raise UnsupportedDecoder(f"decoder {kind!r} is not supported")
    parts = config.get("decoders") or []
    kinds = [p.get("type") for p in parts]
    if set(kinds) <= {"ByteLevel", "Fuse"} and "ByteLevel" in kinds:
        return DecoderPlan(byte_level=True)
    if kinds in (["Metaspace"], ["Metaspace", "Fuse"]):
        return _metaspace(parts[0])
    replaces: list[tuple[str, str]] = []
    byte_fallback = fused = False
    strip: tuple[str, int] | None = None
    for part, part_kind in zip(parts, kinds, strict=True):
        if strip is not None:
            raise UnsupportedDecoder("decoders after Strip are not supported")
        if part_kind == "Replace":
            pattern = part.get("pattern", {})
            if "String" not in pattern or byte_fallback or fused:
                raise UnsupportedDecoder("only string Replace before ByteFallback/Fuse")
            replaces.append((pattern["String"], part["content"]))
        elif part_kind == "ByteFallback":
            byte_fallback = True
        elif part_kind == "Fuse":
            fused = True
        elif part_kind == "Strip":
            if not fused or part.get("stop", 0) != 0:
                raise UnsupportedDecoder("only Strip(start=n, stop=0) after Fuse")
            strip = (part["content"], int(part.get("start", 0)))
        else:
            raise UnsupportedDecoder(f"decoder {part_kind!r} in a Sequence is not supported")
    if strip is not None and strip[1] == 0:
        strip = None
    return DecoderPlan(replaces=tuple(replaces), byte_fallback=byte_fallback, strip=strip)


def _metaspace(config: dict[str, Any]) -> DecoderPlan:
    replacement = config.get("replacement", "▁")
    scheme = config.get("prepend_scheme")
    if scheme is None:
        scheme = "always" if config.get("add_prefix_space", True) else "never"
    drop = None if scheme == "never" else replacement
    return DecoderPlan(replaces=((replacement, " "),), first_token_drop=drop)


def token_id_string(token_id: int) -> str:
    """The `token` text used with return_tokens_as_token_ids (vLLM's "token_id:N")."""
    return f"token_id:{token_id}"


class TokenBytes:
    """Precomputed per-id bytes for one tokenizer.

    `vocab_size` may exceed the tokenizer's size (a padded LM head); ids without a piece have
    no bytes. Ids outside [0, size) raise IndexError.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int | None = None) -> None:
        spec = json.loads(tokenizer.to_str())
        self.plan = plan_decoder(spec.get("decoder"))
        size = max(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size or 0)
        table: list[bytes] = []
        first: dict[int, bytes] = {}
        for token_id in range(size):
            piece = tokenizer.id_to_token(token_id)
            if piece is None:
                table.append(b"")
                continue
            data = self.plan.piece_bytes(piece)
            table.append(data)
            if self.plan.first_token_drop and self.plan.first_token_drop in piece:
                first[token_id] = self.plan.piece_bytes(piece, first=True)
        self._table = table
        self._strings = [data.decode("utf-8", errors="replace") for data in table]
        self._partial = frozenset(t for t, text in enumerate(self._strings)
                                  if text.endswith(REPLACEMENT))
        """Ids whose own text ends in U+FFFD: the ones `token_string_after` corrects."""
        self._never_completed = frozenset(t for t in self._partial
                                          if _ends_unfinished(table[t]))
        """Partial ids no context can complete: their U+FFFD is not in the leading run of
        continuation bytes, and UTF-8 decodes from the first other byte on alike after any
        prefix."""
        self._first = first
        self._special = frozenset(
            t["id"] for t in spec.get("added_tokens", []) if t.get("special") and t["id"] < size
        )

    @property
    def size(self) -> int:
        return len(self._table)

    @property
    def strip(self) -> tuple[str, int] | None:
        return self.plan.strip

    def _check(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._table):
            raise IndexError(f"token id {token_id} outside [0, {len(self._table)})")

    def bytes_of(self, token_id: int) -> bytes:
        """The token's true bytes (never lossy: partial UTF-8 stays partial)."""
        self._check(token_id)
        return self._table[token_id]

    def first_bytes_of(self, token_id: int) -> bytes:
        """The bytes the token contributes when it is the first decoded token."""
        self._check(token_id)
        return self._first.get(token_id, self._table[token_id])

    def is_special(self, token_id: int) -> bool:
        """A special added token: skip_special_tokens removes it from the text."""
        self._check(token_id)
        return token_id in self._special

    def token_string(self, token_id: int) -> str:
        """The token's own text: its bytes as UTF-8 with errors="replace".

        A token holding part of a character shows U+FFFD here; `bytes_of` keeps the truth.
        Leading spaces are kept (the stream's Strip does not apply to a lone token), like
        vLLM's decoded tokens after it restores SentencePiece's stripped leading space.
        """
        self._check(token_id)
        return self._strings[token_id]

    def token_string_after(self, token_id: int, context: Sequence[int]) -> str:
        """The token's text as vLLM reports it after the sequence `context` (the tokens
        sampled before it, oldest first; vLLM's LogprobsProcessor._correct_decoded_token). A
        text that does not end in U+FFFD is `token_string`. Otherwise the token is decoded
        after its last 1, 2, 3 or 4 context tokens, the first time that completes the text;
        the text of the trailing context tokens that ended in U+FFFD themselves (the earlier
        bytes of the same character) is attributed to this token, the rest is cut off. When no
        context completes it (the character continues in a later token): "", so joining the
        tokens' texts gives the decoded text."""
        return self.token_strings_after([token_id], context)[0]

    def token_strings_after(self, token_ids: list[int], context: Sequence[int]) -> list[str]:
        """`token_string_after` of each id, all after the same context (the alternatives of
        one position)."""
        strings = self.token_strings(token_ids)
        partial = self._partial
        if partial.isdisjoint(token_ids):
            return strings
        windows = self._windows(context)
        return [self._completed(token_id, windows) if token_id in partial else text
                for token_id, text in zip(token_ids, strings, strict=True)]

    def _windows(self, context: Sequence[int]) -> list[tuple[bytes, str]]:
        """(bytes, clean prefix text) of the last 1..4 context tokens; the clean prefix is the
        text of the window before its trailing tokens whose own text ends in U+FFFD. Empty
        when the last context token is not partial: its bytes then end a character, so every
        window leaves a partial token's text ending in U+FFFD (nothing can complete it)."""
        context = list(context[-MAX_CONTEXT:])
        self._check_all(context)
        partial, table = self._partial, self._table
        if not context or context[-1] not in partial:
            return []
        windows = []
        for count in range(1, len(context) + 1):
            window = context[-count:]
            clean = len(window)
            while clean and window[clean - 1] in partial:
                clean -= 1
            prefix = b"".join(table[t] for t in window[:clean]).decode("utf-8", "replace")
            windows.append((b"".join(table[t] for t in window), prefix))
        return windows

    def _completed(self, token_id: int, windows: list[tuple[bytes, str]]) -> str:
        if token_id in self._never_completed:
            return ""
        data = self._table[token_id]
        for window, prefix in windows:
            whole = (window + data).decode("utf-8", "replace")
            if whole.endswith(REPLACEMENT):
                continue
            if whole.startswith(prefix):
                return whole[len(prefix):]
            pairs = zip(prefix, whole, strict=False)
            shared = next((i for i, (a, b) in enumerate(pairs) if a != b),
                          min(len(prefix), len(whole)))
            return whole[shared:]
        return ""

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """`token_string` of each id (one range check for the whole list)."""
        self._check_all(token_ids)
        strings = self._strings
        return [strings[token_id] for token_id in token_ids]

    def bytes_of_each(self, token_ids: list[int]) -> list[bytes]:
        """`bytes_of` each id (one range check for the whole list)."""
        self._check_all(token_ids)
        table = self._table
        return [table[token_id] for token_id in token_ids]

    def _check_all(self, token_ids: list[int]) -> None:
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < len(self._table):
            self._check(next(t for t in token_ids if not 0 <= t < len(self._table)))

    @staticmethod
    def token_id_string(token_id: int) -> str:
        return token_id_string(token_id)
