"""A partial-UTF-8 token's text after its context, against vLLM's correction run on the real
tokenizer: LogprobsProcessor._correct_decoded_token decodes the token after its last 1-4
sampled tokens with `tokenizer.decode` (tests/tokenizer_fixtures.py writes it out)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.tokenizer_fixtures import (
    TEXTS,
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    byte_token_id,
    random_ids,
    vllm_token_text,
)

TOKENIZERS = {"byte_level": byte_level_tokenizer, "byte_fallback": byte_fallback_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokens(request):
    tok = TOKENIZERS[request.param]()
    return tok, TokenBytes(tok)


def check_sequence(tok, tb: TokenBytes, ids: list[int], alternatives: list[int]) -> None:
    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    for i, token_id in enumerate(ids):
        context = ids[:i]
        for candidate in (token_id, *alternatives):
            expected = vllm_token_text(decode, tb.token_string(candidate), candidate, context)
            assert tb.token_string_after(candidate, context) == expected, (ids, i, candidate)


@pytest.mark.parametrize("text", TEXTS)
def test_texts_of_split_characters_match_vllm(tokens, text):
    tok, tb = tokens
    ids = tok.encode(text, add_special_tokens=False).ids
    check_sequence(tok, tb, ids, [byte_token_id(tok, b) for b in (0xE4, 0xB8, 0xAD, 0x41)])


def test_a_character_split_into_bytes_reads_as_one_token_after_the_other(tokens):
    """The lead bytes report "" and the completing byte the whole character, so the tokens'
    texts join to the text (vLLM's reason for the correction)."""
    tok, tb = tokens
    ids = [byte_token_id(tok, b) for b in "中".encode()]
    texts = [tb.token_string_after(t, ids[:i]) for i, t in enumerate(ids)]
    assert texts == ["", "", "中"]
    assert tb.token_string_after(ids[1], []) == ""  # (no context: vLLM's "")
    assert tb.token_strings_after([ids[2], ids[0]], ids[:2]) == ["中", ""]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_sequences_match_vllm(tokens, data):
    tok, tb = tokens
    ids = data.draw(random_ids(tok, max_size=12))
    alternatives = data.draw(random_ids(tok, max_size=3))
    check_sequence(tok, tb, ids, alternatives)
