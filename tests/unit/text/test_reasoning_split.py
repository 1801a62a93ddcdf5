"""ReasoningSplit: vLLM's qwen3 / deepseek_r1 split of generated text into reasoning and
content, the same whichever way the text arrives in pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_logprobs.runtime.text.reasoning import (
    ReasoningCounter,
    ReasoningSplit,
    ReasoningStrings,
    ReasoningTokens,
    count_reasoning_tokens,
    prompt_ends_reasoning,
)

THINK = ReasoningStrings("<think>", "</think>")


def split_reasoning(text: str, strings: ReasoningStrings) -> tuple[str, str | None]:
    """The whole text's (reasoning, content), content None when empty (vLLM's `content or
    None`)."""
    reasoning, content = ReasoningSplit(strings).feed(text, final=True)
    return reasoning, content or None


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>abc</think>\n012", "abc", "\n012"),
    ("abc</think>done", "abc", "done"),  # the start string may be in the prompt
    ("<think>still thinking", "still thinking", None),  # no end: all reasoning
    ("</think>", "", None),
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first end string splits
    ("<thin", "<thin", None),
])
def test_whole_text(text, reasoning, content):
    assert split_reasoning(text, THINK) == (reasoning, content)


@pytest.mark.parametrize("text", ["<think>abc</think>\n012", "xy</think>", "<think>no end <",
                                  "ab</thi</think>c<think>d"])
def test_any_pieces_join_to_the_whole_split(text):
    """Fed in pieces of any size and cut, the split joins to the whole text's, and the content
    starts at the same place in the fed text (where Responses' entries may begin)."""
    whole = split_reasoning(text, THINK)
    for cuts in ([i] for i in range(len(text) + 1)):
        for step in (1, 2, 3):
            split = ReasoningSplit(THINK)
            pieces = [text[:cuts[0]]] + [text[i:i + step] for i in range(cuts[0], len(text), step)]
            got = [split.feed(piece) for piece in pieces] + [split.feed("", final=True)]
            reasoning = "".join(r for r, _ in got)
            content = "".join(c for _, c in got) or None
            assert (reasoning, content) == whole, (pieces, got)
            end = text.find("</think>")
            assert split.content_start == (None if end < 0 else end + len("</think>"))


CHARS = ReasoningTokens(tuple(map(ord, "<think>")), tuple(map(ord, "</think>")), THINK)
"""The delimiters as multi-token sequences: one token per character."""


@pytest.mark.parametrize("text", ["<think>abc</think>\n012", "abc</think>done",
                                  "<think>still thinking", "</think>", "a</think>b</think>c",
                                  "<thin", "<think>a<think>b</think>", "", "ab</thi</think>c"])
def test_reasoning_tokens_are_the_reasoning_texts_tokens(text):
    """With one token per character, the count is the length of the split's reasoning text:
    the tokens before the first end sequence, less those of start sequences."""
    reasoning, _ = split_reasoning(text, THINK)
    assert count_reasoning_tokens([ord(c) for c in text], CHARS) == len(reasoning)


def test_single_token_delimiters():
    tokens = ReasoningTokens((7,), (9,))
    assert count_reasoning_tokens([7, 1, 2, 3, 9, 4, 5], tokens) == 3
    assert count_reasoning_tokens([1, 2, 9, 4, 9], tokens) == 2
    assert count_reasoning_tokens([1, 7, 2], tokens) == 2
    assert count_reasoning_tokens([], tokens) == 0


@pytest.mark.parametrize(("prompt", "ended"), [
    ("", False), ("plain", False), ("<think>", False), ("<think>a</think>", True),
    ("a</think>b", True), ("<think>a</think>b<think>", False), ("</think><think>", False),
    ("<think></thin", False),
])
def test_a_prompt_ends_reasoning_when_its_last_delimiter_is_the_end(prompt, ended):
    assert prompt_ends_reasoning([ord(c) for c in prompt], CHARS) is ended
    assert prompt_ends_reasoning([7, 9] if ended else [9, 7], ReasoningTokens((7,), (9,))) is ended


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.sampled_from([1, 2, 3, 7, 8, 9]), max_size=30),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_counting_as_tokens_arrive_equals_counting_the_whole(ids, cuts):
    """Fed in any pieces, the counter agrees with the whole output at every point: the count
    of the text read so far, with the held tokens placed as if the output ended there."""
    tokens = ReasoningTokens((7, 8), (8, 9))
    counter = ReasoningCounter(tokens)
    bounds = sorted({0, len(ids), *[c for c in cuts if c <= len(ids)]})
    for a, b in zip(bounds, bounds[1:], strict=False):
        counter.feed(ids[a:b])
        assert counter.total() == count_reasoning_tokens(ids[:b], tokens)
        assert len(counter.pending) < 2


def test_the_count_reads_left_to_right():
    tokens = ReasoningTokens((7, 8), (8, 9))
    assert count_reasoning_tokens([1, 7, 8, 2, 8, 9, 3], tokens) == 2  # start skipped, end stops
    assert count_reasoning_tokens([1, 7, 8, 9], tokens) == 2  # 7 8 is the start; 9 counts
    assert count_reasoning_tokens([1, 8, 9, 7, 8], tokens) == 1
