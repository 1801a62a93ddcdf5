from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios_logprobs.runtime.outputs import Finished, GeneratedToken, TokenLogprob
from helios_logprobs.runtime.text.detokenizer import Detokenizer, TokenStart
from helios_logprobs.runtime.text.stops import OutputStream, StopFilter
from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.tokenizer_fixtures import (
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    byte_token_id,
    eos_id,
    random_ids,
)

HYPO = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def gen(ids: list[int], *, forced: tuple[int, ...] = ()) -> list[GeneratedToken]:
    return [
        GeneratedToken(
            index=i,
            token_id=t,
            logprob=None if i in forced else -0.25 * (i + 1),
            alternatives=(TokenLogprob(t, -0.25 * (i + 1)),),
        )
        for i, t in enumerate(ids)
    ]


def run(tb: TokenBytes, tokens: list[GeneratedToken], stops=(), **kwargs):
    stream = OutputStream(tb, stops, **kwargs)
    # What the stream may hold, whatever the output's length: the tokens of a partial
    # character (4 bytes at most), a tail of at most the longest stop's length in characters
    # and the entries of the tokens that made it (a token carries at least one byte, so at
    # most 4 per character: '!!' + one 3-byte character of 3 byte tokens holds 3 characters
    # and 5 entries), and silent tokens (no text: a skipped special token) after a held tail
    # or a partial character, queued until what precedes them is decided.
    skip = kwargs.get("skip_special_tokens", True)
    longest = max((len(s) for s in stops), default=0)
    silent_count = 0
    chunks = []
    for token in tokens:
        chunks.append(stream.push(token))
        silent_count += silent_alone(tb, token.token_id, skip)
        bound = 4 + longest + 4 * longest + silent_count
        assert stream.retained <= bound
        if stream.done:
            break
    chunks.append(stream.finish(Finished("stop")))
    text = "".join(c.text for c in chunks)
    entries = [(tok.index, off) for c in chunks for tok, off in c.entries]
    stop = next((c.stop for c in chunks if c.stop), None)
    return text, entries, stop, chunks


def silent_alone(tb: TokenBytes, token_id: int, skip_special_tokens: bool) -> bool:
    """Whether the token alone decodes to no text (a skipped special token, no bytes)."""
    det = Detokenizer(tb, skip_special_tokens=skip_special_tokens)
    starts = [s for step in (det.feed(token_id), det.finish()) for s in step.starts]
    return bool(starts) and all(s.silent for s in starts)


def offsets_of(tb: TokenBytes, ids: list[int]) -> list[int]:
    from helios_logprobs.runtime.text.detokenizer import detokenize

    return detokenize(tb, ids, at_start=False)[1]


def test_stop_across_tokens(level_tokens) -> None:
    tok, tb = level_tokens
    ids = tok.encode("Hello world STOP here").ids
    text, entries, stop, _ = run(tb, gen(ids), ["STOP"])
    assert (text, stop) == ("Hello world ", "STOP")
    offsets = offsets_of(tb, ids)
    assert entries == [(i, o) for i, o in enumerate(offsets) if o < len(text)]
    assert entries[-1][0] < len(ids) - 1


def test_stop_inside_a_token_keeps_the_partial_token(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    ids = tok.encode("Hello STOP").ids
    stop_token = ids.index(tok.token_to_id("▁STOP"))
    text, entries, stop, _ = run(tb, gen(ids), ["TO"])
    assert (text, stop) == ("Hello S", "TO")
    assert [i for i, _ in entries] == list(range(stop_token + 1))
    assert tb.bytes_of(ids[stop_token]) == b" STOP"


def test_stop_at_the_very_first_token(level_tokens) -> None:
    tok, tb = level_tokens
    ids = tok.encode("STOP and more").ids
    text, entries, stop, chunks = run(tb, gen(ids), ["ST", "more"])
    assert (text, entries, stop) == ("", [], "ST")
    assert len(chunks) <= 3


def test_stop_on_a_split_character(fallback_tokens) -> None:
    from helios_logprobs.runtime.text.detokenizer import detokenize

    tok, tb = fallback_tokens
    ids = tok.encode("ab 語x").ids
    pieces = [byte_token_id(tok, b) for b in "語".encode()]
    first = ids.index(pieces[0])
    assert ids[first : first + 3] == pieces
    full, offsets = detokenize(tb, ids)
    text, entries, stop, _ = run(tb, gen(ids), ["語"])
    assert (text, stop) == (full[: full.index("語")], "語")
    assert entries == [(i, offsets[i]) for i in range(first)]


def test_include_stop_str_in_output(level_tokens) -> None:
    tok, tb = level_tokens
    ids = tok.encode("Hello STOP world").ids
    text, entries, _, _ = run(tb, gen(ids), ["STOP"], include_stop_str_in_output=True)
    assert text == "Hello STOP"
    offsets = offsets_of(tb, ids)
    assert entries == [(i, o) for i, o in enumerate(offsets) if o < len(text)]


def test_first_stop_is_the_one_that_ends_first() -> None:
    f: StopFilter[str] = StopFilter(["abcd", "c", "xbc"])
    out = f.push("xabcde")
    assert (out.text, out.stop) == ("xab", "c")
    f = StopFilter(["b", "ab"])
    out = f.push("zab")
    assert (out.text, out.stop) == ("z", "ab")


def test_holdback_is_bounded_and_released() -> None:
    f: StopFilter[int] = StopFilter(["STOP!", "x"])
    s = lambda i, o: (i, TokenStart(i, o, False))  # noqa: E731
    out = f.push("abST", [s(0, 0), s(1, 2)])
    assert (out.text, [e for e, _ in out.entries]) == ("ab", [0])
    assert f.held_chars == 2 and f.queued_entries == 1
    out = f.push("OP", [s(2, 4)])
    assert out.text == "" and f.held_chars == 4
    out = f.push("?")
    assert out.text == "abSTOP?"[2:] and [e for e, _ in out.entries] == [1, 2]
    assert f.held_chars == 0 and f.queued_entries == 0
    assert f.finish().text == ""


def test_ignore_eos_keeps_entry_in_order_and_terminating_eos_has_none(level_tokens) -> None:
    tok, tb = level_tokens
    eos = eos_id(tok)
    ids = [*tok.encode("Hi").ids, eos, *tok.encode(" there").ids]
    text, entries, _, _ = run(tb, gen(ids))
    assert text == "Hi there"
    assert [i for i, _ in entries] == list(range(len(ids)))
    assert entries[len(ids) - ids[::-1].index(eos) - 1][1] == 2
    # A terminating EOS is reported only as Finished.stop_token_id: never an entry.
    stream = OutputStream(tb)
    for token in gen(tok.encode("Hi").ids):
        stream.push(token)
    last = stream.finish(Finished("stop", stop_token_id=eos))
    assert all(t.token_id != eos for t, _ in last.entries)


def test_silent_eos_right_before_a_stop_is_kept(level_tokens) -> None:
    tok, tb = level_tokens
    eos = eos_id(tok)
    ids = [*tok.encode("Hi").ids, eos, *tok.encode("STOP").ids]
    text, entries, _, _ = run(tb, gen(ids), ["STOP"])
    assert text == "Hi"
    assert [i for i, _ in entries] == list(range(ids.index(eos) + 1))


def test_forced_tokens_have_no_entry(level_tokens) -> None:
    tok, tb = level_tokens
    ids = tok.encode("Hello world").ids
    text, entries, _, _ = run(tb, gen(ids, forced=(1,)))
    assert text == "Hello world"
    assert [i for i, _ in entries] == [i for i in range(len(ids)) if i != 1]


def test_chunks_carry_entries_of_the_text_they_release(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    ids = tok.encode("中文 日本語 🙂 done STOP after").ids
    _, entries, _, chunks = run(tb, gen(ids), ["STOP", "🙃"])
    seen = 0
    for chunk in chunks:
        for _, off in chunk.entries:
            assert off < seen + len(chunk.text)
        seen += len(chunk.text)
    assert [i for i, _ in entries] == list(range(len(entries)))


ALPHABET = "abcSTOP中 "


@HYPO
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include=st.booleans(),
)
def test_chunking_does_not_change_the_result(text, stops, cuts, include) -> None:
    # One "token" per character; the oracle works on the whole text at once.
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        end, begin, stop = min(hits)
        cut = end if include else begin
    else:
        cut, stop = len(text), None
    f: StopFilter[int] = StopFilter(stops, include_stop_str_in_output=include)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out_text, out_entries, out_stop = "", [], None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        starts = [(i, TokenStart(i, i, False)) for i in range(lo, hi)]
        released = f.push(text[lo:hi], starts)
        out_text += released.text
        out_entries += [e for e, _ in released.entries]
        assert f.held_chars <= max((len(s) - 1 for s in stops), default=0)
        if released.stop:
            out_stop = released.stop
            break
    tail = f.finish()
    out_text += tail.text
    out_entries += [e for e, _ in tail.entries]
    assert (out_text, out_stop) == (text[:cut], stop)
    assert out_entries == list(range(min(cut, len(text))))


@pytest.mark.parametrize("build", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_stream_matches_whole_sequence_oracle(build) -> None:
    tok = build()
    tb = TokenBytes(tok)

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(random_ids(tok), st.integers(0, 30), st.integers(1, 4), st.booleans())
    def check(ids: list[int], at: int, length: int, include: bool) -> None:
        det = Detokenizer(tb)
        steps = [det.feed(t) for t in ids] + [det.finish()]
        text = "".join(s.text for s in steps)
        starts = [s for step in steps for s in step.starts]
        stops = [text[at : at + length] or "zz", "\ufffd\ufffd"]
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        end, begin, stop = min(hits) if hits else (len(text) + 1, len(text), None)
        cut = end if include and hits else begin
        # Silent tokens placed after the stop's end are generated after it: never pushed.
        keep = [
            s.index
            for s in starts
            if (s.offset <= cut and s.offset < end if s.silent else s.offset < cut)
        ]
        out, entries, got_stop, _ = run(tb, gen(ids), stops, include_stop_str_in_output=include)
        assert (out, got_stop) == (text[:cut], stop)
        assert entries == [(i, starts[i].offset) for i in keep]

    check()


def test_stop_strings_wait_for_min_tokens(level_tokens) -> None:
    """vLLM matches stop strings only once more than min_tokens tokens exist: a stop inside
    the first min_tokens tokens is kept in the text, a later one still ends the output."""
    tok, tb = level_tokens
    ids = tok.encode("ab STOP cd STOP ef").ids
    first = next(i for i in range(len(ids)) if "STOP" in tok.decode(ids[: i + 1]))
    text, _, stop, _ = run(tb, gen(ids), ["STOP"], min_tokens=first + 1)
    assert (text, stop) == ("ab STOP cd ", "STOP")
    assert run(tb, gen(ids), ["STOP"], min_tokens=first)[:3:2] == ("ab ", "STOP")


def test_a_held_tail_of_multi_token_characters_stays_bounded(level_tokens):
    """Hypothesis found it: '!!' and a 3-byte character of three byte tokens are held as a
    prefix of the stop (3 characters, 5 entries) while the next token starts another
    character; the stop then completes and nothing is released."""
    _, tb = level_tokens
    text, entries, stop, _ = run(tb, gen([3, 3, 159, 97, 97, 129]),
                                 ["!!\u0861\ufffd", "\ufffd\ufffd"])
    assert (text, entries, stop) == ("", [], "!!\u0861\ufffd")
