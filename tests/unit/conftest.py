"""Fixtures shared by the unit tests of the text and HTTP layers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.tokenizer_fixtures import byte_fallback_tokenizer, byte_level_tokenizer


@pytest.fixture(scope="module")
def level_tokens() -> tuple[Tokenizer, TokenBytes]:
    """The byte-level BPE test tokenizer and its TokenBytes."""
    tok = byte_level_tokenizer()
    return tok, TokenBytes(tok)


@pytest.fixture(scope="module")
def fallback_tokens() -> tuple[Tokenizer, TokenBytes]:
    """The byte-fallback (SentencePiece-style) test tokenizer and its TokenBytes."""
    tok = byte_fallback_tokenizer()
    return tok, TokenBytes(tok)
