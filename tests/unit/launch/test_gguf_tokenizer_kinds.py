"""The GGUF tokenizer kinds beyond SmolLM2's: SentencePiece-style vocabularies (byte fallback,
merges from the file or derived from the scores, BOS added) and byte-level BPE under the
``llama-bpe`` and ``qwen2`` pre-tokenizers, each written into a GGUF file here and compared
token for token with transformers' own conversion of that file."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import tokenizers

from helios_logprobs.launch.gguf_tokenizer import gguf_tokenizer
from helios_logprobs.launch.model_source import default_gguf
from helios_logprobs.ranks.model.gguf import metadata_value, open_gguf

gguf = pytest.importorskip("gguf")

CORPUS = (
    "the theme of the thesis",
    "Ünïcödé naïve 日本 🤖 bytes",
    "  two  spaces and\ttab\nnewline 12345 6789",
    "<s>the</s> <unk> control",
    "it's 2026: 100,000 tokens!!",
)
PIECES = ("▁", "t", "h", "e", "m", "s", "i", "o", "f", "a", "n", "d", "c", "r", "w", "l", "p",
          "▁t", "th", "▁th", "▁the", "he", "▁o", "▁of", "es", "is", "▁a", "an", "▁an", "nd",
          "▁and", "▁s", "on", "ol", "▁c", "▁co", "ntrol", "tr", "ro")


def write(path: Path, model: str, tokens: list[str], types: list[int], **extra) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "scores" in extra:
        writer.add_token_scores(extra["scores"])
    if "merges" in extra:
        writer.add_token_merges(extra["merges"])
    if "pre" in extra:
        writer.add_tokenizer_pre(extra["pre"])
    if "add_bos" in extra:
        writer.add_add_bos_token(extra["add_bos"])
    writer.add_bos_token_id(extra.get("bos", 1))
    writer.add_eos_token_id(extra.get("eos", 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_file(path: Path, with_merges: bool) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(PIECES)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(PIECES))]]
    extra = {"scores": scores}
    if with_merges:
        vocab = {t: i for i, t in enumerate(tokens)}
        extra["merges"] = [f"{a} {b}" for t in PIECES for i in range(1, len(t))
                           if (a := t[:i]) in vocab and (b := t[i:]) in vocab]
    return write(path, "llama", tokens, types, **extra)


BYTE_LEVEL_TOKENS = 4000
"""The head of SmolLM2's vocabulary the byte-level cases keep: its specials, the 256 byte
symbols and the first merges' results (a whole conversion of 49,152 ids is ~10 s a case)."""


def byte_level_file(path: Path, pre: str) -> Path:
    """SmolLM2's vocabulary head and the merges within it under another pre-tokenizer name,
    with BOS added."""
    tokens, types, merges = byte_level_head()
    return write(path, "gpt2", tokens, types, merges=merges, pre=pre, add_bos=True)


@cache
def byte_level_head() -> tuple[list[str], list[int], list[str]]:
    source = open_gguf(default_gguf())
    tokens = metadata_value(source, "tokenizer.ggml.tokens")[:BYTE_LEVEL_TOKENS]
    kept = set(tokens)
    merges = [m for m in metadata_value(source, "tokenizer.ggml.merges")
              if (pair := m.split(" ")) and all(t in kept for t in pair)
              and "".join(pair) in kept]
    assert len(merges) > BYTE_LEVEL_TOKENS // 2  # (most of the head is merge results)
    return tokens, metadata_value(source, "tokenizer.ggml.token_type")[:BYTE_LEVEL_TOKENS], merges


def compare(path: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer, _ = gguf_tokenizer(open_gguf(path))
    ours = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # as saved to tokenizer.json
    for text in CORPUS:
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special).ids == expected, text
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


@pytest.mark.parametrize("with_merges", [True, False], ids=["merges", "scores"])
def test_sentencepiece_with_byte_fallback(tmp_path, with_merges):
    path = sentencepiece_file(tmp_path / "sp.gguf", with_merges)
    compare(path)
    tokenizer, config = gguf_tokenizer(open_gguf(path))
    assert config["add_bos_token"] and tokenizer.encode("the").ids[0] == 1
    assert "<0xC3>" in [tokenizer.id_to_token(i) for i in tokenizer.encode("Ü").ids]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_pre_tokenizers(tmp_path, pre):
    compare(byte_level_file(tmp_path / f"{pre}.gguf", pre))
