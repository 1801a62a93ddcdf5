"""What presentation needs from the model directory: tokenizer, token bytes, chat template,
sampling defaults."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.runtime.http.protocol.defaults import FROM_MODEL, load_sampling_defaults
from helios_logprobs.runtime.http.protocol.tools import ToolServing
from helios_logprobs.runtime.text.chat_template import ChatTemplate
from helios_logprobs.runtime.text.token_bytes import TokenBytes

UNBLOCKED_ENCODE_CHARS = 16_384
"""Texts at least this long are encoded with `encode_batch`, which releases the GIL (`encode`
holds it for the whole call: seconds for megabytes, during which no other thread runs)."""
LENGTH_PRESERVING_NORMALIZERS = frozenset({"Prepend", "Replace", "Sequence"})
"""Normalizers under which every input character still costs at least one byte of some token
(the tokenizers of Llama and Qwen2 checkpoints use these or none)."""


def _normalizers(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    kinds = {spec.get("type", "?")}
    for inner in spec.get("normalizers") or ():
        kinds |= _normalizers(inner)
    return kinds


def _replace_shrinks(spec: dict | None) -> bool:
    """A Replace normalizer whose content is shorter than its pattern may drop characters."""
    if not spec:
        return False
    if spec.get("type") == "Replace":
        pattern = spec.get("pattern") or {}
        source = pattern.get("String") if isinstance(pattern, dict) else None
        return source is None or len(spec.get("content", "")) < len(source)
    return any(_replace_shrinks(inner) for inner in spec.get("normalizers") or ())


class ModelAssets:
    """What presentation needs from the model directory."""

    def __init__(self, model_dir: str | Path, served_model_name: str | Sequence[str],
                 vocab_size: int, generation_config: str = FROM_MODEL) -> None:
        self.model_dir = Path(model_dir)
        names = (served_model_name,) if isinstance(served_model_name, str) else tuple(
            served_model_name)
        if not names or not all(names):
            raise ValueError(f"served model names must be non-empty, got {names}")
        self.served_model_names = names
        """Every name requests may give as `model` (--served-model-name), each listed by
        /v1/models."""
        self.served_model_name = names[0]
        """The name responses carry (vLLM's: the first)."""
        self.sampling_defaults = load_sampling_defaults(generation_config, self.model_dir)
        self.tokenizer = tokenizers.Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.token_bytes = TokenBytes(self.tokenizer, vocab_size)
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)
        self.tool_serving = ToolServing()
        """--tool-call-parser / --enable-auto-tool-choice (set by launch.serve.build_app)."""
        self.eos_token_id = self._tokenizer_eos()
        """The tokenizer's EOS (tokenizer_config.json `eos_token`), vLLM's primary EOS, or None."""
        self.max_token_chars = self._max_token_chars()
        # Long texts are encoded by the batch call, which releases the GIL. The `_fast` form
        # (tokenizers >= 0.21) skips the offsets: 3x faster, and dropping the encoding of
        # millions of tokens then costs ~3 ms under the GIL instead of ~200 ms.
        self._encode_unblocked = getattr(self.tokenizer, "encode_batch_fast",
                                         self.tokenizer.encode_batch)

    def _tokenizer_eos(self) -> int | None:
        path = self.model_dir / "tokenizer_config.json"
        if not path.is_file():
            return None
        token = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def _max_token_chars(self) -> int | None:
        """The most input characters one token can stand for, or None when the normalizer may
        drop characters or the model fuse unknown ones (then no bound is derived from the text
        alone). Every character is at least one byte of its BPE token, so the longest token in
        bytes (or added token in characters) bounds it."""
        full = json.loads(self.tokenizer.to_str())
        spec, model = full.get("normalizer"), full.get("model") or {}
        if not _normalizers(spec) <= LENGTH_PRESERVING_NORMALIZERS or _replace_shrinks(spec):
            return None
        if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
            return None  # a fused unknown token may stand for any run of characters
        longest = max((len(self.token_bytes.bytes_of(t)) for t in range(self.token_bytes.size)),
                      default=1)
        added = [len(a.content) for a in self.tokenizer.get_added_tokens_decoder().values()]
        return max(longest, *added, 1)

    def check_length(self, text: str, max_model_len: int, param: str) -> None:
        """Refuse, before tokenizing, a text that alone proves it leaves no room in the
        context: more characters than max_model_len - 1 tokens of the longest can hold."""
        longest = self.max_token_chars
        if longest is not None and len(text) > (max_model_len - 1) * longest:
            raise RequestError(
                param,
                f"You passed {len(text)} input characters. However, the model's context length "
                f"is only {max_model_len} tokens (at most {(max_model_len - 1) * longest} "
                f"characters with this tokenizer, whose longest token has {longest}). Please "
                f"reduce the length of the input prompt.",
            )

    def word_ids(self, text: str) -> list[int]:
        """A word's ids without special tokens (bad_words)."""
        return self.encode(text, add_special_tokens=False, param="bad_words")

    def encode(self, text: str, *, add_special_tokens: bool, param: str,
               max_model_len: int | None = None) -> list[int]:
        """The text's ids; with `max_model_len`, a text whose length alone proves it does not
        fit is refused before tokenization (the exact count is checked by the caller)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(param, f"text is not valid Unicode: {exc.reason}") from exc
        if max_model_len is not None:
            self.check_length(text, max_model_len, param)
        if len(text) >= UNBLOCKED_ENCODE_CHARS:
            return self._encode_unblocked([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def accepts_model(self, name: str | None) -> bool:
        return name in (None, "", *self.served_model_names, str(self.model_dir))
