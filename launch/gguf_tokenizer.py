"""A ``tokenizers.Tokenizer`` (and its tokenizer_config.json) from a GGUF file's vocabulary.

GGUF stores the vocabulary, merges, token types and special ids as metadata under llama.cpp's
names. ``tokenizer.ggml.model`` says which tokenizer they describe: ``gpt2`` (byte-level BPE,
its pre-tokenizer split named by ``tokenizer.ggml.pre``) or ``llama`` (SentencePiece-style BPE
with byte fallback; merges from the file or, when absent, derived from the scores). The
result equals transformers' own GGUF conversion (integrations/gguf/gguf_tokenizer_mapping.py):
the tests hold it to that, token for token.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from helios_logprobs.ranks.model.errors import UnsupportedModelError
from helios_logprobs.ranks.model.gguf import metadata_value

CONTROL, USER_DEFINED = 3, 4
"""llama.cpp's token types: special tokens such as <|im_end|>; plain added ones (<think>)."""

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}
"""``tokenizer.ggml.pre`` -> the split regex its merges were learned with. Others (gpt2,
smollm, ...) get GPT-2's own byte-level split, as transformers gives them."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    byte_values = list(printable)
    for byte in range(256):
        if byte not in printable:
            byte_values.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(byte_values, chars, strict=True)}


def gguf_tokenizer(reader: Any) -> tuple[Tokenizer, dict[str, Any]]:
    """(the tokenizer, its tokenizer_config.json) that a GGUF file's metadata describes."""
    kind = metadata_value(reader, "tokenizer.ggml.model")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise UnsupportedModelError("the GGUF file holds no tokenizer vocabulary")
    types = metadata_value(reader, "tokenizer.ggml.token_type") or []
    merges = metadata_value(reader, "tokenizer.ggml.merges")
    config = _tokenizer_config(reader, tokens, kind)
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, merges, metadata_value(reader, "tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = metadata_value(reader, "tokenizer.ggml.scores")
        tokenizer = _sentencepiece(tokens, merges, scores)
    else:
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model {kind!r}; supported: "
                                    f"gpt2 (byte-level BPE), llama (SentencePiece BPE)")
    _add_special_tokens(tokenizer, tokens, types, byte_level=kind == "gpt2")
    named = [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)
               if t is not None and t not in added]
    if missing:  # transformers adds the tokenizer's named special tokens as special ones
        tokenizer.add_special_tokens(missing)
    tokenizer.post_processor = _post_processor(config, tokenizer)
    return tokenizer, config


def _tokenizer_config(reader: Any, tokens: list[str], kind: str | None) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = metadata_value(reader, f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    defaults = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    add_bos = metadata_value(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama"  # llama.cpp's default for SentencePiece vocabularies
    config: dict[str, Any] = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(metadata_value(reader, "tokenizer.ggml.add_eos_token", False)),
    }
    if kind == "llama":  # LlamaTokenizer's own names, where the file gives no id
        for key, name in defaults.items():
            if config[key] is None and name in tokens:
                config[key] = name
    template = metadata_value(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _byte_level(tokens: list[str], merges: list[str] | None, pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())
        vocab[key] = index
    pairs = [tuple(merge.split(" ")) for merge in merges or ()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(tokens: list[str], merges: list[str] | None,
                   scores: list[float] | None) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = derive_merges(vocab, dict(zip(tokens, scores or [0.0] * len(tokens),
                                              strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True,
                                     byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                       split=False)
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])
    return tokenizer


def derive_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into two vocabulary
    pieces, best score first (transformers' generate_merges with vocab_scores)."""
    found = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int],
                        byte_level: bool) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens (both
    matched whole). A byte-level CONTROL token spelled outside the byte alphabet is a llama.cpp
    mislabel and is skipped, as transformers does."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)


def _post_processor(config: dict[str, Any], tokenizer: Tokenizer) -> Any:
    """BOS/EOS around a sequence as tokenizer_config asks (transformers' update_post_processor)."""
    bos, eos = config["bos_token"], config["eos_token"]
    add_bos = config["add_bos_token"] and bos is not None
    add_eos = config["add_eos_token"] and eos is not None
    first, last = (f"{bos}:0 " if add_bos else ""), (f" {eos}:0" if add_eos else "")
    single = f"{first}$A:0{last}"
    pair = (f"{single}{f' {bos}:1' if add_bos else ''} $B:1"
            f"{f' {eos}:1' if add_eos else ''}")
    special = []
    if add_bos:
        special.append((bos, tokenizer.token_to_id(bos)))
    if add_eos:
        special.append((eos, tokenizer.token_to_id(eos)))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
