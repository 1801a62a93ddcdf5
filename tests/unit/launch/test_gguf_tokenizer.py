"""The tokenizer built from a GGUF vocabulary (launch/gguf_tokenizer.py) equals transformers'
own GGUF conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) token for token, on
SmolLM2's byte-level BPE (pre-tokenizer ``smollm``): non-ASCII text, digits, whitespace runs,
special tokens; and the chat template, BOS/EOS it carries."""

from __future__ import annotations

import json
from functools import cache

import pytest
import tokenizers

from helios_logprobs.launch.model_source import default_gguf, resolve_model

CORPUS = (
    "Hello, world!",
    "Ünïcödé — naïve café, 日本語のテキスト, Привет мир, 🤖🚀 emoji",
    "Digits 0 7 42 1234567890 3.14159 1,000,000 and 2026-12-06T03:22Z",
    "   leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain<|im_end|><|im_start|>",
    "def f(x):\n    return x ** 2  # comment\n",
    "it's they're I'll we've SHOUTING MiXeD",
    "",
)


@cache
def ours() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(resolve_model(None, None).path / "tokenizer.json"))


@cache
def theirs():
    from transformers import AutoTokenizer

    path = default_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_transformers_gguf_conversion(text):
    for special in (True, False):
        expected = theirs()(text, add_special_tokens=special)["input_ids"]
        assert ours().encode(text, add_special_tokens=special).ids == expected


def test_decoding_round_trips_like_transformers():
    for text in CORPUS:
        ids = ours().encode(text).ids
        assert ours().decode(ids, skip_special_tokens=False) == theirs().decode(ids)


def test_special_tokens_and_chat_template():
    config = json.loads((resolve_model(None, None).path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (theirs().bos_token,
                                                          theirs().eos_token)
    assert config["chat_template"] == theirs().chat_template
    specials = {t.content for t in ours().get_added_tokens_decoder().values() if t.special}
    assert set(theirs().all_special_tokens) <= specials
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= specials
