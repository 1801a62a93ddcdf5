"""ModelAssets.encode: long texts take the GIL-releasing batch call; the ids must be the
tokenizer's own `encode` ids (the oracle), for both tokenizer families and with specials."""

from __future__ import annotations

import pytest

from helios_logprobs.runtime.http.assets import UNBLOCKED_ENCODE_CHARS, ModelAssets
from tests.tokenizer_fixtures import TEXTS, byte_fallback_tokenizer, byte_level_tokenizer


@pytest.mark.parametrize("build", [byte_level_tokenizer, byte_fallback_tokenizer])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_long_text_ids_equal_the_tokenizers_encode(tmp_path, build, add_special_tokens):
    tokenizer = build()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assets = ModelAssets(tmp_path, "m", tokenizer.get_vocab_size(with_added_tokens=True))
    special = "<|im_start|>" if build is byte_level_tokenizer else "</s>"
    piece = " ".join(TEXTS) + f" {special} "
    text = (piece * (UNBLOCKED_ENCODE_CHARS // len(piece) + 2))
    assert len(text) >= UNBLOCKED_ENCODE_CHARS
    for sample in (text, text[: UNBLOCKED_ENCODE_CHARS - 1], text + "🙂 tail"):
        expected = tokenizer.encode(sample, add_special_tokens=add_special_tokens).ids
        got = assets.encode(sample, add_special_tokens=add_special_tokens, param="prompt")
        assert got == expected
