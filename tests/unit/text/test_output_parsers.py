"""Output parsers on scripted token streams: the reasoning split and the hermes / llama3_json
tool parsers give the same events however the text is cut (delimiters split across tokens),
every content event is the exact source slice it names, malformed tool JSON is content, and
the attribution queue keeps exactly the tokens whose first byte is content, holding each only
until its text is consumed."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_logprobs.runtime.text.parsers.events import CONTENT, REASONING, Piece, ToolCall
from helios_logprobs.runtime.text.parsers.pipeline import (
    Attribution,
    OutputParser,
    ParserSettings,
)
from helios_logprobs.runtime.text.reasoning import ReasoningStrings

THINK = ReasoningStrings("<think>", "</think>")
QWEN3 = ParserSettings(reasoning=THINK)
HERMES = ParserSettings(tool_parser="hermes")
BOTH = ParserSettings(reasoning=THINK, tool_parser="hermes")
LLAMA = ParserSettings(tool_parser="llama3_json")


def ids():
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def run(settings_: ParserSettings, pieces: list[str]):
    parser = OutputParser(settings_, new_id=ids())
    events = []
    for i, piece in enumerate(pieces):
        events += parser.feed(piece, final=i == len(pieces) - 1)
    return events


def summary(events) -> list:
    """Adjacent pieces of one kind merged (how they were cut does not matter)."""
    out: list = []
    for event in events:
        if isinstance(event, Piece):
            if out and isinstance(out[-1], tuple) and out[-1][0] == event.kind:
                out[-1] = (event.kind, out[-1][1] + event.text)
            else:
                out.append((event.kind, event.text))
        else:
            out.append((event.name, json.loads(event.arguments)))
    return out


def check_sources(events, text: str) -> None:
    for event in events:
        if isinstance(event, Piece) and event.start is not None:
            assert text[event.start:event.end] == event.text


def all_cuts(text: str, parts: int = 2):
    for cut in itertools.combinations(range(1, len(text)), parts - 1):
        bounds = [0, *cut, len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def check_every_cut(settings_: ParserSettings, text: str, expected: list) -> None:
    whole = run(settings_, [text])
    check_sources(whole, text)
    assert summary(whole) == expected
    for pieces in itertools.chain(all_cuts(text, 2), all_cuts(text, 3)):
        events = run(settings_, pieces)
        check_sources(events, text)
        assert summary(events) == expected, pieces


def vllm_reasoning(text: str) -> list:
    """vLLM's qwen3 extract_reasoning, written from its source (str.partition)."""
    before, found, after = text.partition(THINK.start)
    text = after if found else before
    if THINK.end in text:
        reasoning, _, content = text.partition(THINK.end)
    else:
        reasoning, content = text, ""
    return [(kind, part) for kind, part in ((REASONING, reasoning), (CONTENT, content)) if part]


@pytest.mark.parametrize("text", ["<think>abc</think>\n012", "abc</think>done",
                                  "<think>still thinking", "</think>", "<thin", "ab</thin"])
def test_reasoning_split_is_vllms_whatever_the_cuts(text):
    check_every_cut(QWEN3, text, vllm_reasoning(text))


def test_prompt_that_closed_thinking_makes_everything_content():
    events = run(ParserSettings(reasoning=THINK, reasoning_ended=True), ["a</think>b"])
    assert summary(events) == [(CONTENT, "a</think>b")]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "expected"), [
    ("plain text", [(CONTENT, "plain text")]),
    (CALL, [("get_weather", {"city": "paris"})]),
    ("Let me check.\n" + CALL + "\n",
     [(CONTENT, "Let me check.\n"), ("get_weather", {"city": "paris"})]),
    (CALL + "\n " + CALL.replace("paris", "rome"),  # whitespace between calls stripped
     [("get_weather", {"city": "paris"}), ("get_weather", {"city": "rome"})]),
    ('<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}}}</tool_call>',
     [("f", {"a": {"b": [1, {"c": "}"}]}})]),  # nested, a brace inside a string
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>after',
     [(CONTENT, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>after')]),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     [(CONTENT, '<tool_call>{"name": 3, "arguments": {}}</tool_call>')]),
    ('<tool_call>{"name": "f", "arguments": {"x": "y"}}',  # unclosed at the end, valid
     [("f", {"x": "y"})]),
    ('<tool_call>{"name": "f", "arguments"', [(CONTENT, '<tool_call>{"name": "f", "arguments"')]),
    ("a <tool_c b", [(CONTENT, "a <tool_c b")]),
])
def test_hermes_whatever_the_cuts(text, expected):
    check_every_cut(HERMES, text, expected)


def test_hermes_after_reasoning_and_without_parallel_calls():
    text = "<think>hmm</think>" + CALL + CALL.replace("paris", "rome")
    check_every_cut(BOTH, text, [(REASONING, "hmm"), ("get_weather", {"city": "paris"}),
                                 ("get_weather", {"city": "rome"})])
    single = ParserSettings(reasoning=THINK, tool_parser="hermes", parallel_tool_calls=False)
    events = run(single, [text])
    assert summary(events) == [(REASONING, "hmm"), ("get_weather", {"city": "paris"})]
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.index, c.id) for c in calls] == [(0, "call-0")]


@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}',
     [("f", {"a": 1}), ("g", {})]),
    ('{"name": "f", "parameters": {"a": 1}', [(CONTENT, '{"name": "f", "parameters": {"a": 1}')]),
    ('{"name": "f"}', [(CONTENT, '{"name": "f"}')]),
    ("The answer is {1}", [(CONTENT, "The answer is {1}")]),
    ("<|python", [(CONTENT, "<|python")]),
])
def test_llama3_json_whatever_the_cuts(text, expected):
    check_every_cut(LLAMA, text, expected)


# ----------------------------------------------------------------------------- attribution
class Token:
    """A scripted token: its bytes and where its first byte lies in the text (characters)."""

    def __init__(self, raw: bytes, text_offset: int) -> None:
        self.raw, self.text_offset = raw, text_offset


def stream(settings_: ParserSettings, raws: list[bytes]):
    """Feed tokens as a detokenizer releases them (whole characters only); returns the text,
    the events, the kept tokens and the attribution queue."""
    parser, queue = OutputParser(settings_, new_id=ids()), Attribution()
    data, released, events, kept = b"", "", [], []
    for i, raw in enumerate(raws):
        # The character holding the token's first byte: the complete characters before it.
        token = Token(raw, len(data.decode("utf-8", errors="ignore")))
        data += raw
        text = data.decode("utf-8", errors="ignore")
        new, released = text[len(released):], text
        queue.add([token])
        fresh = parser.feed(new, final=i == len(raws) - 1)
        queue.note(fresh)
        events += fresh
        kept += queue.release(parser.consumed)
    kept += queue.finish()
    return released, events, kept, queue


def content_tokens_oracle(raws: list[bytes], content_start_byte: int) -> list[bytes]:
    """Tokens whose first byte is at or after the content's first byte."""
    out, at = [], 0
    for raw in raws:
        if at >= content_start_byte:
            out.append(raw)
        at += len(raw)
    return out


def test_multibyte_character_split_at_the_boundary():
    e_acute = "é".encode()
    # Reasoning "xé", the end string, content "éy": each é is cut between two tokens, and the
    # second byte of the reasoning's é rides with the end string.
    raws = [b"<think>", b"x", e_acute[:1], e_acute[1:] + b"</think>", e_acute[:1],
            e_acute[1:], b"y"]
    text, events, kept, _ = stream(QWEN3, raws)
    assert summary(events) == [(REASONING, "xé"), (CONTENT, "éy")]
    check_sources(events, text)
    start = len(b"<think>x" + e_acute + b"</think>")
    assert [t.raw for t in kept] == content_tokens_oracle(raws, start)
    assert [t.raw for t in kept] == [e_acute[:1], e_acute[1:], b"y"]


def test_tool_data_delimiters_and_stripped_whitespace_get_nothing():
    raws = [b"Hi", b" ", b"<tool_call>", b'{"name": "f", ', b'"arguments": {}}',
            b"</tool_call>", b"\n", b" ", b"ok"]
    text, events, kept, _ = stream(HERMES, raws)
    assert summary(events) == [(CONTENT, "Hi "), ("f", {}), (CONTENT, "ok")]
    assert [t.raw for t in kept] == [b"Hi", b" ", b"ok"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "é", "<", "think>", "</", "think", ">", " ", "\n",
                                 "€", "x"]), min_size=1, max_size=24))
def test_kept_tokens_are_those_whose_first_byte_is_content(pieces):
    raws = [piece.encode() for piece in pieces]
    raws = [r for raw in raws for r in ((raw[:1], raw[1:]) if len(raw) > 1 else (raw,))]
    text, events, kept, _ = stream(QWEN3, raws)
    data = b"".join(raws)
    body = data.decode()
    cut = body.find(THINK.end)
    start = len(data) if cut < 0 else len(body[:cut + len(THINK.end)].encode())
    # The content starts at a character boundary: a token's first byte is content iff the
    # byte lies at or after it.
    assert [t.raw for t in kept] == content_tokens_oracle(raws, start)
    check_sources(events, text)


@pytest.mark.parametrize("parser_settings", [QWEN3, BOTH, HERMES])
def test_queue_holds_entries_only_until_their_text_is_consumed(parser_settings):
    """A long stream (reasoning, then content): the queue never holds more tokens than the
    longest delimiter can span, and every content token comes out."""
    raws = [b"<think>"] + [b"ab "] * 400 + [b"</", b"think>"] + [b"cd "] * 400
    _, _, kept, queue = stream(parser_settings, raws)
    assert queue.most_pending <= len("</tool_call>")
    assert not queue.pending and len(queue.ranges) <= 1
    if parser_settings.reasoning is not None:
        assert len(kept) == 400
    else:  # all output is content
        assert len(kept) == len(raws)


SCHEMA = {"w": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}
QWEN3_CODER = ParserSettings(tool_parser="qwen3_coder", tool_parameters=SCHEMA)
CODER_CALL = ("<tool_call>\n<function=w>\n<parameter=city>\nparis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n2.5\n</parameter>\n"
              "<parameter=metric>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
              "<parameter=other>\nnull\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize(("text", "expected"), [
    ("Sure.\n" + CODER_CALL + "\n",
     [(CONTENT, "Sure.\n"), ("w", {"city": "paris", "days": 3, "temp": 2.5, "metric": True,
                                   "tags": ["a"], "other": None})]),
    ("<tool_call><function=w><parameter=days>x</parameter></function></tool_call>",
     [("w", {"days": "x"})]),  # (vLLM's: a value that does not convert stays a string)
    ("<tool_call>no function here</tool_call>",
     [(CONTENT, "<tool_call>no function here</tool_call>")]),
])
def test_qwen3_coder(text, expected):
    events = run(QWEN3_CODER, [text])
    check_sources(events, text)
    assert summary(events) == expected
    for pieces in all_cuts(text, 2):
        assert summary(run(QWEN3_CODER, pieces)) == expected
