"""Real `tokenizers` tokenizers built in-process (no downloads), shared by unit and server tests.

* `byte_level_tokenizer()`: GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder),
  like Llama 3 / Qwen2. Specials: <|endoftext|> (EOS), <|im_start|>, <|im_end|>; one added
  non-special token.
* `byte_fallback_tokenizer()`: SentencePiece-style BPE with byte_fallback=True and <0xNN>
  pieces in the base vocabulary, Metaspace pre-tokenizer, decoder Replace("▁", " ") +
  ByteFallback + Fuse + Strip(" ", 1, 0), like Llama 2 / Mistral. Specials <unk>, <s>, </s>.

Both vocabularies are small, so characters outside the corpus (CJK, emoji, accented letters)
are split into several byte tokens. Builders are cached: do not mutate what they return; use
`fresh=True` for a private copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from functools import cache

from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from helios_logprobs.runtime.text.token_bytes import TokenBytes, gpt2_byte_decoder

CORPUS = [
    "Hello world, the café is naïve and the piñata is full.",
    "The quick brown fox jumps over the lazy dog. Stop here.",
    "中文字符 中国 文字 hello 世界",
    "emoji 🙂 party 🎉 and more words: STOP, end, ###",
    "plain ascii words here and there, more words, hello again",
] * 4

TEXTS = [
    "Hello world",
    "the café is naïve",
    "中文 and 日本語 mixed",
    "emoji 🙂🎉 🤖 done",
    "Ünïcödé ñ ß ø",
    "STOP here ### or there",
    "  leading spaces",
    "a\ufffdb literal replacement",
]

# Lead bytes, continuation bytes, invalid bytes, the pieces of U+FFFD.
TRICKY = [0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x99, 0x82, 0xC3, 0xA9, 0xEF, 0xBF, 0xBD, 0xFF, 0x80, 0xE0]

BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_LEVEL_ADDED = "<tool>"
BYTE_FALLBACK_SPECIALS = ["<unk>", "<s>", "</s>"]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=BYTE_LEVEL_SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(BYTE_LEVEL_ADDED, normalized=False)])
    return tok


def _byte_fallback() -> Tokenizer:
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = metaspace
    base.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=260, show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = {name: i for i, name in enumerate(BYTE_FALLBACK_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in BYTE_FALLBACK_SPECIALS]
    )
    return tok


_cached_byte_level = cache(_byte_level)
_cached_byte_fallback = cache(_byte_fallback)


def byte_level_tokenizer(*, fresh: bool = False) -> Tokenizer:
    return _byte_level() if fresh else _cached_byte_level()


def byte_fallback_tokenizer(*, fresh: bool = False) -> Tokenizer:
    return _byte_fallback() if fresh else _cached_byte_fallback()


def metaspace_decoder_tokenizer() -> Tokenizer:
    """The byte-fallback vocabulary with a plain Metaspace decoder (no ByteFallback)."""
    tok = _byte_fallback()
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return tok


def eos_id(tok: Tokenizer) -> int:
    for name in ("<|endoftext|>", "</s>"):
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    raise KeyError("no EOS token")


def random_ids(tok: Tokenizer, max_size: int = 40) -> st.SearchStrategy[list[int]]:
    """Hypothesis id lists: any id, with extra weight on split/invalid UTF-8 bytes and EOS."""
    tricky = [byte_token_id(tok, b) for b in TRICKY] + [eos_id(tok)]
    ids = st.one_of(st.integers(0, tok.get_vocab_size() - 1), st.sampled_from(tricky))
    return st.lists(ids, max_size=max_size)


def byte_token_id(tok: Tokenizer, value: int) -> int:
    """The byte-fallback tokenizer's <0xNN> id, or the byte-level id of the single byte."""
    token_id = tok.token_to_id(f"<0x{value:02X}>")
    if token_id is None:
        char = next(c for c, b in gpt2_byte_decoder().items() if b == value)
        token_id = tok.token_to_id(char)
    if token_id is None:
        raise KeyError(value)
    return token_id


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _byte_piece(tok: Tokenizer, token_id: int) -> int | None:
    match = re.fullmatch(r"<0x([0-9A-F]{2})>", tok.id_to_token(token_id))
    return int(match.group(1), 16) if match else None


def byte_fallback_runs(tok: Tokenizer, ids: list[int]) -> list[bytes]:
    """The byte strings of the runs of consecutive <0xNN> tokens (specials skipped)."""
    runs, run = [], b""
    for token_id in ids:
        if tok.id_to_token(token_id) in BYTE_FALLBACK_SPECIALS:
            continue
        value = _byte_piece(tok, token_id)
        if value is not None:
            run += bytes([value])
        elif run:
            runs, run = [*runs, run], b""
    return [*runs, run] if run else runs


def byte_fallback_reference(tok: Tokenizer, ids: list[int]) -> str:
    """tokenizers' Replace+ByteFallback+Fuse+Strip(1) decode, specials skipped: a run of
    <0xNN> tokens with any invalid byte becomes one U+FFFD per byte."""
    parts: list[str] = []
    run = b""
    for token_id in [*ids, None]:
        if token_id is not None and tok.id_to_token(token_id) in BYTE_FALLBACK_SPECIALS:
            continue
        value = None if token_id is None else _byte_piece(tok, token_id)
        if value is not None:
            run += bytes([value])
            continue
        parts.append(run.decode() if valid_utf8(run) else "\ufffd" * len(run))
        run = b""
        if token_id is not None:
            parts.append(tok.id_to_token(token_id).replace("▁", " "))
    text = "".join(parts)
    return text[1:] if text.startswith(" ") else text


# Oracles for detokenized text and offsets, computed on whole sequences.


def joined_bytes(tb: TokenBytes, ids: list[int], skip: bool = True) -> list[bytes]:
    out, first = [], tb.plan.first_token_drop is not None
    for token_id in ids:
        if skip and tb.is_special(token_id):
            out.append(b"")
        elif first:
            out.append(tb.first_bytes_of(token_id))
            first = False
        else:
            out.append(tb.bytes_of(token_id))
    return out


def lossy_oracle(tb: TokenBytes, ids: list[int]) -> str:
    """Our documented semantics: concatenated bytes, maximal-subpart replacement, Strip."""
    text = b"".join(joined_bytes(tb, ids)).decode("utf-8", errors="replace")
    return text[1:] if tb.strip and text.startswith(" ") else text


def offsets_oracle(tb: TokenBytes, ids: list[int], strip: int = 1) -> list[int]:
    """Offsets for sequences whose bytes are valid UTF-8 (char boundaries are unambiguous)."""
    datas = joined_bytes(tb, ids)
    raw = b"".join(datas).decode()
    starts = [len(raw[:c].encode()) for c in range(len(raw))]
    stripped = len(raw) - len(raw.lstrip(" ")) if tb.strip else 0
    stripped = min(stripped, strip)
    out, pos, total = [], 0, len(b"".join(datas))
    for data in datas:
        inside = pos not in starts and pos < total
        if (data and pos + len(data) > stripped) or inside:
            k = max(c for c, s in enumerate(starts) if s <= pos)
        else:
            k = sum(1 for s in starts if s < pos)
        out.append(k - min(k, stripped))
        pos += len(data)
    return out


def byte_offsets_oracle(tb: TokenBytes, ids: list[int]) -> dict[int, int]:
    """Offsets of tokens with bytes, for any bytes: a position B is a character boundary of
    the replaced decoding iff decoding both sides separately gives no extra character."""
    datas = joined_bytes(tb, ids)
    raw = b"".join(datas)
    n = lambda b: len(b.decode("utf-8", errors="replace"))  # noqa: E731
    whole = raw.decode("utf-8", errors="replace")
    stripped = 1 if tb.strip and whole.startswith(" ") else 0
    out, pos = {}, 0
    for index, data in enumerate(datas):
        if data and pos + len(data) > stripped:
            before = n(raw[:pos])
            k = before if before + n(raw[pos:]) == len(whole) else before - 1
            out[index] = k - min(k, stripped)
        pos += len(data)
    return out


FFFD = "\ufffd"


def vllm_token_text(decode: Callable[[list[int]], str], own: str, token_id: int,
                    context: Sequence[int]) -> str:
    """vLLM's text of a token after the tokens sampled before it (written out from vLLM's
    LogprobsProcessor._correct_decoded_token, sharing no code with runtime/): `own` unless it
    ends in U+FFFD; then the first 1..4-token context whose `decode` with the token does not
    end in U+FFFD, less the decode of the context before its trailing U+FFFD-ending tokens;
    "" when none does."""
    if not own.endswith(FFFD):
        return own
    context = list(context)
    for n in range(1, min(len(context), 4) + 1):
        window = context[-n:]
        full = decode(window + [token_id])
        if full.endswith(FFFD):
            continue
        clean_end = len(window)
        for j in range(len(window) - 1, -1, -1):
            if decode([window[j]]).endswith(FFFD):
                clean_end = j
            else:
                break
        prefix = decode(window[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def vllm_sequence_texts(decode: Callable[[list[int]], str], owns: Sequence[str],
                        ids: Sequence[int]) -> list[str]:
    """`vllm_token_text` of each token of a sequence after the tokens before it."""
    return [vllm_token_text(decode, own, token_id, ids[:i])
            for i, (token_id, own) in enumerate(zip(ids, owns, strict=True))]
