from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from helios_logprobs.runtime.text.token_bytes import (
    DecoderPlan,
    TokenBytes,
    UnsupportedDecoder,
    gpt2_byte_decoder,
    plan_decoder,
    token_id_string,
)
from tests.tokenizer_fixtures import (
    BYTE_FALLBACK_SPECIALS,
    BYTE_LEVEL_ADDED,
    BYTE_LEVEL_SPECIALS,
    TEXTS,
    byte_level_tokenizer,
    byte_token_id,
    metaspace_decoder_tokenizer,
)


def test_gpt2_byte_map_is_the_byte_level_alphabet() -> None:
    table = gpt2_byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["!"] == 0x21


def test_byte_level_every_id_matches_single_token_decode(level_tokens) -> None:
    tok, tb = level_tokens
    assert tb.plan == DecoderPlan(byte_level=True)
    for token_id in range(tok.get_vocab_size()):
        data = tb.bytes_of(token_id)
        assert tok.decode([token_id], skip_special_tokens=False) == data.decode(
            "utf-8", errors="replace"
        )
        assert tb.token_string(token_id) == data.decode("utf-8", errors="replace")


def test_byte_level_single_bytes_are_exact(level_tokens) -> None:
    tok, tb = level_tokens
    for value in range(256):
        assert tb.bytes_of(byte_token_id(tok, value)) == bytes([value])


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_concatenation_is_the_utf8_text(level_tokens, text: str) -> None:
    tok, tb = level_tokens
    ids = tok.encode(text).ids
    assert b"".join(tb.bytes_of(i) for i in ids) == text.encode()
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_concatenation_is_space_plus_text(fallback_tokens, text: str) -> None:
    tok, tb = fallback_tokens
    ids = tok.encode(text).ids
    joined = b"".join(tb.bytes_of(i) for i in ids)
    # Metaspace (prepend_scheme="first") adds a leading "▁" unless the text starts with a
    # space; the Strip(" ", 1, 0) decoder removes one leading space.
    assert joined == (text if text.startswith(" ") else " " + text).encode()
    assert tok.decode(ids) == joined.decode()[1:]


def test_byte_fallback_pieces(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    assert tb.strip == (" ", 1)
    for value in range(256):
        token_id = tok.token_to_id(f"<0x{value:02X}>")
        assert tb.bytes_of(token_id) == bytes([value])
        assert not tb.is_special(token_id)
    assert tb.bytes_of(tok.token_to_id("▁")) == b" "
    assert tb.bytes_of(tok.token_to_id("▁Hello")) == b" Hello"
    assert tb.bytes_of(tok.token_to_id("é")) == "é".encode()


def test_partial_utf8_token_keeps_true_bytes(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    lead = byte_token_id(tok, 0xE4)
    assert tb.bytes_of(lead) == b"\xe4"
    assert tb.token_string(lead) == "\ufffd"
    # The peer failure: re-encoding the replaced string loses the byte.
    assert tb.token_string(lead).encode() != tb.bytes_of(lead)


def test_token_string_restores_the_stripped_leading_space(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    for token_id in range(tok.get_vocab_size()):
        single = tok.decode([token_id], skip_special_tokens=False)
        text = tb.token_string(token_id)
        assert single == (text[1:] if text.startswith(" ") else text)


def test_special_and_added_tokens(level_tokens, fallback_tokens) -> None:
    tok, tb = level_tokens
    for name in BYTE_LEVEL_SPECIALS:
        token_id = tok.token_to_id(name)
        assert tb.is_special(token_id)
        assert tb.bytes_of(token_id) == name.encode()
    added = tok.token_to_id(BYTE_LEVEL_ADDED)
    assert not tb.is_special(added) and tb.bytes_of(added) == BYTE_LEVEL_ADDED.encode()
    tok, tb = fallback_tokens
    for name in BYTE_FALLBACK_SPECIALS:
        assert tb.is_special(tok.token_to_id(name))
        assert tb.bytes_of(tok.token_to_id(name)) == name.encode()


def test_added_tokens_follow_the_decoder() -> None:
    tok = byte_level_tokenizer(fresh=True)
    tok.add_tokens(["naïve", "日本"])
    tb = TokenBytes(tok)
    # 'ï' is a GPT-2 map character (byte 0xEF), '日' is not: tokenizers' decoder agrees.
    naive, japan = tok.token_to_id("naïve"), tok.token_to_id("日本")
    assert tb.bytes_of(naive) == b"na\xefve"
    assert tok.decode([naive]) == tb.token_string(naive) == "na\ufffdve"
    assert tb.bytes_of(japan) == "日本".encode()


def test_padded_vocab_and_range(level_tokens) -> None:
    tok, _ = level_tokens
    size = tok.get_vocab_size()
    tb = TokenBytes(tok, vocab_size=size + 5)
    assert tb.size == size + 5
    assert tb.bytes_of(size + 4) == b"" and tb.token_string(size + 4) == ""
    for bad in (-1, size + 5):
        with pytest.raises(IndexError):
            tb.bytes_of(bad)


def test_token_id_string() -> None:
    assert token_id_string(42) == "token_id:42"
    assert TokenBytes.token_id_string(0) == "token_id:0"


def test_metaspace_decoder_first_token_rule() -> None:
    tok = metaspace_decoder_tokenizer()
    tb = TokenBytes(tok)
    hello = tok.token_to_id("▁Hello")
    assert tb.bytes_of(hello) == b" Hello"
    assert tb.first_bytes_of(hello) == b"Hello"
    assert tb.first_bytes_of(tok.token_to_id("▁")) == b""
    assert tok.decode([tok.token_to_id("▁"), hello]) == " Hello"


def test_plan_decoder_configs() -> None:
    legacy = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": False}
    assert plan_decoder(legacy).first_token_drop is None
    gemma = json.loads(
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        .__getstate__()
        .decode()
    )
    assert plan_decoder(gemma) == DecoderPlan(replaces=(("▁", " "),), byte_fallback=True)


@pytest.mark.parametrize(
    "decoder",
    [
        None,
        decoders.WordPiece(),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)]),
        decoders.Sequence([decoders.Fuse(), decoders.Strip(" ", 0, 1)]),
        decoders.Sequence([decoders.ByteFallback(), decoders.Replace("▁", " ")]),
    ],
)
def test_unsupported_decoders_are_refused(decoder) -> None:
    tok = Tokenizer(models.BPE())
    tok.decoder = decoder
    with pytest.raises(UnsupportedDecoder):
        TokenBytes(tok)
