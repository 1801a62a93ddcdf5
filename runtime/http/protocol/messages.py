"""Chat messages, kept as given (extra keys reach the chat template) and checked by
`parse_messages`, which names the offending message and key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helios_logprobs.ranks.contract.requests import RequestError


@dataclass(frozen=True)
class ChatMessage:
    """One checked message: `fields` is what the template sees (the message's own non-null
    keys, `content` as text); `content` is None only for an assistant message with tool calls
    (its `fields` then have no `content`)."""

    role: str
    content: str | None
    fields: dict[str, Any]


def _message_error(where: str, message: str) -> RequestError:
    return RequestError("messages", f"{where}: {message}")


def _content_text(content: Any, where: str) -> str:
    """A string, or text parts joined with newlines (vLLM's rule); any other part is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _message_error(
            where, f"must be a string or a list of content parts, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _message_error(at, "a content part must be an object")
        kind = part.get("type")
        if kind is None:
            raise _message_error(f"{at}.type", "a content part needs a type")
        if kind != "text":
            raise _message_error(f"{at}.type", f"Unsupported chat content part type: {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise _message_error(f"{at}.text", "a text part needs a string text")
        texts.append(text)
    return "\n".join(texts)


def _calls_tools(message: dict[str, Any]) -> bool:
    calls = message.get("tool_calls")
    return (isinstance(calls, list) and bool(calls)) or message.get("function_call") is not None


def parse_messages(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """Checked messages; RequestError (param "messages", the message naming the key) for a
    missing or non-string role, missing or null content (allowed only for an assistant
    message with tool_calls), content of another type, or a content part other than text."""
    if not messages:
        raise RequestError("messages", "messages must contain at least one message")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role is None:
            raise _message_error(f"{where}.role", "every message needs a role")
        if not isinstance(role, str) or not role:
            raise _message_error(f"{where}.role", "the role must be a non-empty string")
        content = message.get("content")
        if content is None:
            if role != "assistant" or not _calls_tools(message):
                state = "null" if "content" in message else "missing"
                raise _message_error(
                    f"{where}.content",
                    f"content is {state}; only an assistant message with tool_calls may omit it",
                )
            text = None
        else:
            text = _content_text(content, f"{where}.content")
        # Keys whose value is null are dropped, as transformers' apply_chat_template does
        # (a template then sees an assistant tool-call message without `content`).
        fields = {k: v for k, v in message.items() if v is not None}
        if text is not None:
            fields["content"] = text
        out.append(ChatMessage(role, text, fields))
    return out
