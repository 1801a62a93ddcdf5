"""What presentation needs from the model directory: tokenizer, token bytes, chat template."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ranks.requests import RequestError
from runtime.text.chat_template import ChatTemplate
from runtime.text.token_bytes import TokenBytes


class ModelAssets:
    """What presentation needs from the model directory."""

    def __init__(self, model_dir: str | Path, served_model_name: str, vocab_size: int) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.tokenizer = tokenizers.Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.token_bytes = TokenBytes(self.tokenizer, vocab_size)
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(param, f"text is not valid Unicode: {exc.reason}") from exc
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def accepts_model(self, name: str | None) -> bool:
        return name in (None, "", self.served_model_name, str(self.model_dir))
