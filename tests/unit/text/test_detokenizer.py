from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders

from helios_logprobs.runtime.text.detokenizer import Detokenizer, Utf8Stream, detokenize
from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.tokenizer_fixtures import (
    TEXTS,
    TRICKY,
    byte_fallback_reference,
    byte_fallback_runs,
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    byte_offsets_oracle,
    byte_token_id,
    eos_id,
    lossy_oracle,
    metaspace_decoder_tokenizer,
    offsets_oracle,
    random_ids,
    valid_utf8,
)

KINDS = {
    "byte_level": byte_level_tokenizer,
    "byte_fallback": byte_fallback_tokenizer,
    "metaspace": metaspace_decoder_tokenizer,
}
_BUILT: dict[str, tuple[Tokenizer, TokenBytes]] = {}
HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def built(kind: str) -> tuple[Tokenizer, TokenBytes]:
    if kind not in _BUILT:
        tok = KINDS[kind]()
        _BUILT[kind] = (tok, TokenBytes(tok))
    return _BUILT[kind]


def id_lists(kind: str):
    return random_ids(built(kind)[0])


@HYPO
@given(
    data=st.lists(st.sampled_from([*TRICKY, 0x41, 0xED, 0xA0, 0xF4, 0x90, 0xC0]), max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=6),
)
def test_utf8_stream_matches_whole_decode(data: list[int], cuts: list[int]) -> None:
    raw = bytes(data)
    stream, out, last = Utf8Stream(), "", 0
    for cut in sorted(c for c in cuts if c <= len(raw)):
        out += stream.decode(raw[last:cut])
        last = cut
        assert len(stream.pending) <= 3
        assert not stream.pending or raw[:cut].decode("utf-8", "replace").endswith("\ufffd")
    out += stream.decode(raw[last:]) + stream.decode(b"", final=True)
    assert out == raw.decode("utf-8", errors="replace")


def test_surrogate_prefix_is_not_held() -> None:
    stream = Utf8Stream()
    assert stream.decode(b"\xed") == "" and stream.pending == b"\xed"
    assert stream.decode(b"\xa0") == "\ufffd\ufffd" and stream.pending == b""


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_encoded_texts_round_trip_with_offsets(kind: str, text: str) -> None:
    tok, tb = built(kind)
    ids = tok.encode(text).ids
    out, offsets = detokenize(tb, ids)
    assert out == tok.decode(ids)
    assert offsets == offsets_oracle(tb, ids)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_random_ids_equal_decode(kind: str) -> None:
    tok, tb = built(kind)

    @HYPO
    @given(id_lists(kind))
    def check(ids: list[int]) -> None:
        out, offsets = detokenize(tb, ids)
        assert out == tok.decode(ids, skip_special_tokens=True) == lossy_oracle(tb, ids)
        assert offsets == sorted(offsets) and all(0 <= o <= len(out) for o in offsets)
        for index, offset in byte_offsets_oracle(tb, ids).items():
            assert offsets[index] == offset

    check()


def test_random_ids_byte_fallback_documented_difference() -> None:
    tok, tb = built("byte_fallback")

    @HYPO
    @given(id_lists("byte_fallback"))
    def check(ids: list[int]) -> None:
        out, offsets = detokenize(tb, ids)
        for index, offset in byte_offsets_oracle(tb, ids).items():
            assert offsets[index] == offset
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert decoded == byte_fallback_reference(tok, ids)
        assert out == lossy_oracle(tb, ids)
        if all(valid_utf8(run) for run in byte_fallback_runs(tok, ids)):
            assert out == decoded

    check()


def test_documented_difference_example() -> None:
    tok, tb = built("byte_fallback")
    ids = [byte_token_id(tok, 0x41), byte_token_id(tok, 0xFF)]
    assert tok.decode(ids) == "\ufffd\ufffd"
    assert detokenize(tb, ids)[0] == "A\ufffd"


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_releases_only_stable_text(kind: str) -> None:
    tok, tb = built(kind)

    @HYPO
    @given(id_lists(kind))
    def check(ids: list[int]) -> None:
        det = Detokenizer(tb)
        released, seen = "", []
        final_text, final_offsets = detokenize(tb, ids)
        for n, token_id in enumerate(ids, 1):
            step = det.feed(token_id)
            released += step.text
            prefix = lossy_oracle(tb, ids[:n])
            assert final_text.startswith(released)
            assert prefix.startswith(released) and len(prefix) - len(released) <= 1
            for start in step.starts:
                assert (
                    start.offset <= len(released) if start.silent else start.offset < len(released)
                )
                seen.append(start)
            assert det.unreleased_tokens == n - len(seen) <= 4 + ids[:n].count(eos_id(tok))
        seen += det.finish().starts
        assert [s.index for s in seen] == list(range(len(ids)))
        assert [s.offset for s in seen] == final_offsets

    check()


def test_split_character_waits_then_releases() -> None:
    tok, tb = built("byte_fallback")
    det = Detokenizer(tb, at_start=False)
    steps = [det.feed(byte_token_id(tok, b)) for b in (0xE4, 0xB8, 0xAD)]
    assert [s.text for s in steps] == ["", "", "中"]
    assert [s.starts for s in steps[:2]] == [(), ()]
    assert [(s.index, s.offset, s.silent) for s in steps[2].starts] == [
        (0, 0, False),
        (1, 0, False),
        (2, 0, False),
    ]


def test_literal_replacement_character_and_invalid_bytes() -> None:
    tok, tb = built("byte_level")
    b = lambda v: byte_token_id(tok, v)  # noqa: E731
    a = tok.token_to_id("a")
    # A literal U+FFFD produced by the model, then an invalid sequence, then a truncated one.
    ids = [a, b(0xEF), b(0xBF), b(0xBD), b(0xE4), b(0xB8), a, b(0xFF), b(0xE4), b(0xB8), b(0xAD)]
    text, offsets = detokenize(tb, ids)
    assert text == tok.decode(ids) == "a\ufffd\ufffda\ufffd中"
    assert offsets == [0, 1, 1, 1, 2, 2, 3, 4, 5, 5, 5]
    text, offsets = detokenize(tb, [a, b(0xF0), b(0x9F)])
    assert text == tok.decode([a, b(0xF0), b(0x9F)]) == "a\ufffd"
    assert offsets == [0, 1, 1]


def test_special_tokens_are_silent_or_kept() -> None:
    tok, tb = built("byte_level")
    eos, a = eos_id(tok), tok.token_to_id("a")
    lead, cont, last = (byte_token_id(tok, v) for v in (0xE4, 0xB8, 0xAD))
    det = Detokenizer(tb)
    starts = [s for t in (a, eos, lead, eos, cont, last) for s in det.feed(t).starts]
    starts += det.finish().starts
    # EOS between complete characters is silent at 1; inside the split character it belongs
    # to that character.
    assert [(s.offset, s.silent) for s in starts] == [
        (0, False),
        (1, True),
        (1, False),
        (1, False),
        (1, False),
        (1, False),
    ]
    ids = [a, eos, lead, eos, cont, last]
    text, _ = detokenize(tb, ids, skip_special_tokens=False)
    assert text == tok.decode(ids, skip_special_tokens=False)


def test_finish_flushes_partial_bytes() -> None:
    tok, tb = built("byte_level")
    det = Detokenizer(tb)
    assert det.feed(tok.token_to_id("a")).text == "a"
    step = det.feed(byte_token_id(tok, 0xF0))
    assert step.text == "" and step.starts == ()
    step = det.finish()
    assert step.text == "\ufffd" and [(s.index, s.offset) for s in step.starts] == [(1, 1)]
    assert det.finish().text == ""
    with pytest.raises(RuntimeError):
        det.feed(0)


def test_leading_strip_token_is_silent() -> None:
    tok, tb = built("byte_fallback")
    space, hello = tok.token_to_id("▁"), tok.token_to_id("▁Hello")
    det = Detokenizer(tb)
    first = det.feed(space)
    assert first.text == "" and [(s.offset, s.silent) for s in first.starts] == [(0, True)]
    second = det.feed(hello)
    assert second.text == " Hello" and [(s.offset, s.silent) for s in second.starts] == [(0, False)]


@pytest.mark.parametrize("kind", KINDS)
def test_generation_continues_after_prompt(kind: str) -> None:
    tok, tb = built(kind)
    prompt = tok.encode("Hello world").ids
    generated = tok.encode(" the café 中文 🙂", add_special_tokens=False).ids
    det = Detokenizer.after_prompt(tb, prompt)
    text = "".join(det.feed(t).text for t in generated) + det.finish().text
    whole = tok.decode(prompt + generated)
    assert whole == tok.decode(prompt) + text
    bos = tok.token_to_id("<s>")
    if bos is not None:
        det = Detokenizer.after_prompt(tb, [bos])
        text = "".join(det.feed(t).text for t in generated) + det.finish().text
        assert text == tok.decode([bos, *generated])


def test_memory_is_bounded_over_a_long_stream() -> None:
    tok, tb = built("byte_fallback")
    ids = tok.encode("中文 日本語 🙂 café naïve ").ids * 1000
    det = Detokenizer(tb)
    total = 0
    for token_id in ids:
        total += len(det.feed(token_id).text)
        assert det.unreleased_tokens <= 4
        assert len(det._utf8.pending) <= 3
    assert total + len(det.finish().text) == det.text_length > 20000


def test_strip_of_several_spaces() -> None:
    tok = byte_fallback_tokenizer(fresh=True)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 2, 0),
        ]
    )
    tb = TokenBytes(tok)
    space, hello, eos = tok.token_to_id("▁"), tok.token_to_id("▁Hello"), eos_id(tok)
    byte_space = byte_token_id(tok, 0x20)
    cases = [[space, space, space, hello], [space, hello], [hello, hello], [eos, byte_space, hello]]
    for ids in cases:
        text, offsets = detokenize(tb, ids)
        assert text == tok.decode(ids)
        assert offsets == offsets_oracle(tb, ids, strip=2)
