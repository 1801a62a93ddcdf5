"""Chat templates: tokenizer_config.json's `chat_template` rendered with jinja2 like transformers.

The environment matches `transformers`' `apply_chat_template`: a sandbox with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now` and a `tojson`
filter that keeps non-ASCII characters. The template sees `messages`, `add_generation_prompt`,
`bos_token`, `eos_token` (and the other special tokens named in tokenizer_config.json) plus any
`chat_template_kwargs`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template cannot be rendered for these messages (HTTP 400, param "messages")."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = env.from_string(source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's template (chat_template.jinja, else tokenizer_config.json), or None."""
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        tokens = {k: t for k in TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(encoding="utf-8"), tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(  # (vLLM's wording)
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        context = {**self.special_tokens, **kwargs}
        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc
        if continue_final_message:
            text = _continue_final(text, messages)
        return text


def _continue_final(text: str, messages: list[dict[str, Any]]) -> str:
    """Cut the rendering after the final message's content, so generation continues it."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    at = text.rfind(final.strip())
    if at < 0:
        raise ChatTemplateError("the final message's content is not in the rendered template")
    return text[: at + len(final.strip())]
