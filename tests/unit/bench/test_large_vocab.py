"""bench.large_vocab grows the tiny tokenizer: every id must decode to whole characters (so a
benchmark stream without logprobs sends text for every token, as a real checkpoint does)."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from bench.large_vocab import grow_tokenizer
from helios_logprobs.launch.tiny_model import ensure_tiny_model

SIZE = 6_000


def test_grown_tokenizer_keeps_the_tiny_ids_and_every_new_id_has_text():
    tiny_dir = ensure_tiny_model()
    data = json.loads((tiny_dir / "tokenizer.json").read_text(encoding="utf-8"))
    grow_tokenizer(data, SIZE)
    grown = Tokenizer.from_str(json.dumps(data))
    tiny = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))

    assert grown.get_vocab_size() == SIZE
    for token, index in tiny.get_vocab().items():
        assert grown.token_to_id(token) == index
    for index in range(tiny.get_vocab_size(), SIZE):
        text = grown.decode([index])
        assert text and "\ufffd" not in text, (index, text)
    sample = list(range(SIZE - 200, SIZE))
    text = grown.decode(sample)
    assert grown.decode(grown.encode(text, add_special_tokens=False).ids) == text
