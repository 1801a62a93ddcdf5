"""Tool-call parsers (vLLM's `hermes` and `llama3_json`), incremental over the content text.

Both hold a tool call's text until it is whole and valid, then emit it as one `ToolCall`
(name and JSON arguments, vLLM's `json.dumps(arguments, ensure_ascii=False)`): a stream and a
whole response see the same calls, and a malformed call falls back to content instead of
half a call. Text outside calls is content with its source range; the delimiters and the
call's text are tool data (no range).

hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, text
around them. A call whose body is not a JSON object with a string `name` and an object
`arguments` stays content, delimiters included; an unclosed call at the end of the output is
parsed as if closed. Whitespace right after `</tool_call>` is stripped (vLLM's streaming
lstrip).
llama3_json: an output that starts with `{` or `<|python_tag|>` is a list of JSON objects
separated by `;`, each with `name` and `arguments` (or `parameters`); it is held to the end
and, if any object fails, all of it is content (vLLM's). Any other output is content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from helios_logprobs.runtime.text.parsers.events import CONTENT, Event, Piece, ToolCall
from helios_logprobs.runtime.text.parsers.reasoning_parser import partial_tail


def make_tool_call_id() -> str:
    """vLLM's make_tool_call_id: "chatcmpl-tool-" and a random hex uuid."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments_of(obj: Any, *keys: str) -> str | None:
    """The call's arguments as vLLM serializes them, or None when `obj` is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in keys:
        if key in obj:
            value = obj[key]
            return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    return None


class ToolParser:
    """Shared state: the held text, its offset, the calls made so far."""

    def __init__(self, *, parallel: bool = True,
                 new_id: Callable[[], str] = make_tool_call_id) -> None:
        self.parallel = parallel
        self.new_id = new_id
        self.held = ""
        self.held_at: int | None = None
        self.calls = 0

    def _call(self, name: str, arguments: str) -> list[Event]:
        """A valid call as an event; with parallel_tool_calls false, only the first."""
        self.calls += 1
        if not self.parallel and self.calls > 1:
            return []
        return [ToolCall(self.calls - 1, self.new_id(), name, arguments)]

    @property
    def pending_from(self) -> int | None:
        return self.held_at if self.held else None

    def feed(self, text: str, at: int, final: bool = False) -> list[Event]:
        """Events for `text` (content starting at offset `at`, right after what was fed)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inside = False
        self.after_call = False

    def _body(self, body: str) -> list[tuple[str, str]] | None:
        """The calls in one tool call's body, or None when it is malformed."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        arguments = _arguments_of(obj, "arguments")
        return None if arguments is None else [(obj["name"], arguments)]

    def feed(self, text: str, at: int, final: bool = False) -> list[Event]:
        if self.held_at is None:
            self.held_at = at
        base, buf, out, pos = self.held_at, self.held + text, [], 0
        while True:
            if self.inside:
                close = buf.find(self.END, pos + len(self.START))
                if close < 0 and not final:
                    break
                stop = len(buf) if close < 0 else close + len(self.END)
                parsed = self._body(buf[pos + len(self.START):stop if close < 0 else close])
                if parsed is None:
                    out.append(Piece(CONTENT, buf[pos:stop], base + pos))
                else:
                    out += [event for call in parsed for event in self._call(*call)]
                    self.after_call = True
                pos, self.inside = stop, False
                continue
            if self.after_call:
                while pos < len(buf) and buf[pos].isspace():
                    pos += 1
                if pos == len(buf):
                    break
                self.after_call = False
            found = buf.find(self.START, pos)
            if found >= 0:
                if found > pos:
                    out.append(Piece(CONTENT, buf[pos:found], base + pos))
                pos, self.inside = found, True
                continue
            stop = len(buf) - (0 if final else partial_tail(buf[pos:], self.START))
            if stop > pos:
                out.append(Piece(CONTENT, buf[pos:stop], base + pos))
            pos = stop
            break
        self.held, self.held_at = buf[pos:], base + pos
        return out


FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)",
                       re.DOTALL)
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def convert_parameter(value: str, schema: Any) -> Any:
    """vLLM's qwen3_coder _convert_param_value: the text as the parameter's schema type says
    ("null" is None; a value that does not convert stays a string, a bad boolean false)."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(
        schema, dict) else "string"
    if kind in STRING_TYPES:
        return value
    if kind.startswith(INTEGER_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


class Qwen3CoderParser(HermesParser):
    """vLLM's `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...
    </function></tool_call>` (one or more functions per tool call); each value converted by
    the parameter's type in the request's tool schema (`tools`: name -> parameters)."""

    def __init__(self, tools: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tools = tools or {}

    def _body(self, body: str) -> list[tuple[str, str]] | None:
        calls = []
        for whole, unclosed in FUNCTION.findall(body):
            text = whole or unclosed
            name, found, rest = text.partition(">")
            if not found or not name:
                return None
            schema = self.tools.get(name)
            properties = schema.get("properties", schema) if isinstance(schema, dict) else {}
            arguments = {}
            for match in PARAMETER.findall(rest):
                key, found, value = match.partition(">")
                if not found:
                    return None
                value = value.removeprefix("\n").removesuffix("\n")
                arguments[key] = convert_parameter(value, properties.get(key))
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls or None


class Llama3JsonParser(ToolParser):
    BOT = "<|python_tag|>"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode: str | None = None
        """None: undecided; "content": plain text; "tools": held to the end."""

    def feed(self, text: str, at: int, final: bool = False) -> list[Event]:
        if self.held_at is None:
            self.held_at = at
        base, buf = self.held_at, self.held + text
        if self.mode is None and buf:
            if buf.startswith(("{", self.BOT)):
                self.mode = "tools"
            elif self.BOT.startswith(buf) and not final:
                self.held = buf
                return []
            else:
                self.mode = "content"
        if self.mode == "tools" and not final:
            self.held = buf
            return []
        self.held, self.held_at = "", base + len(buf)
        if not buf:
            return []
        if self.mode == "tools":
            calls = self._calls(buf)
            if calls is not None:
                return [event for name, arguments in calls for event in self._call(name, arguments)]
        return [Piece(CONTENT, buf, base)]

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        decoder, calls = json.JSONDecoder(), []
        pos = len(self.BOT) if text.startswith(self.BOT) else 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            arguments = _arguments_of(obj, "arguments", "parameters")
            if arguments is None:
                return None
            calls.append((obj["name"], arguments))
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                return calls
            if text[pos] != ";":
                return None
            pos += 1


class HeldToEnd(ToolParser):
    """A forced call (tool_choice "required" or a named function, constrained by a grammar):
    all output is tool data, parsed at the end; if it does not parse, it is content."""

    def __init__(self, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name

    def feed(self, text: str, at: int, final: bool = False) -> list[Event]:
        if self.held_at is None:
            self.held_at = at
        self.held += text
        if not final:
            return []
        base, buf = self.held_at, self.held
        self.held, self.held_at = "", base + len(buf)
        calls = self._calls(buf)
        if calls is None:
            return [Piece(CONTENT, buf, base)] if buf else []
        return [event for name, arguments in calls for event in self._call(name, arguments)]

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        if self.name is not None:  # vLLM's: the output is the named function's arguments
            return [(self.name, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [(item.get("name"), _arguments_of(item, "parameters")) for item in items
                 if isinstance(item, dict)]
        if len(calls) != len(items) or any(a is None for _, a in calls):
            return None
        return calls  # type: ignore[return-value]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "qwen3_coder": Qwen3CoderParser,
}
"""--tool-call-parser names (vLLM's)."""
