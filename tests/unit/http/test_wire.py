from __future__ import annotations

import json
import math

import pytest
from openai._models import construct_type
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.http.output.wire import (
    NonFiniteLogprob,
    Position,
    chat_logprobs,
    chat_token_logprob,
    completion_logprobs,
    positions,
    prompt_logprobs_list,
    top_logprobs_dict,
    wire_logprob,
    wire_logprobs,
)
from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.outputs import GeneratedToken, PromptLogprob, TokenLogprob
from helios_logprobs.runtime.text.detokenizer import detokenize
from helios_logprobs.runtime.text.stops import OutputStream

SELECTED = WireMode(selected=True)
AS_IDS = WireMode(as_token_ids=True)


def strict_dumps(obj) -> str:
    text = json.dumps(obj, allow_nan=False)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    return text


def alts(*pairs: tuple[int, float]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t, v) for t, v in pairs)


def test_wire_logprob_values() -> None:
    assert wire_logprob(-math.inf) == -9999.0
    assert wire_logprob(-12345.5) == -12345.5
    assert wire_logprob(-0.0) == 0.0 and wire_logprob(-1.25) == -1.25
    for bad in (math.nan, math.inf):
        with pytest.raises(NonFiniteLogprob):
            wire_logprob(bad)
    # A plain clamp max(x, -9999.0) passes NaN on and floors real values: ours does neither
    # (for alternatives and whole responses too: test_nan_never_reaches_json).
    assert wire_logprob(-1e30) == -1e30


def test_wire_logprobs_match_the_one_value_rule() -> None:
    # Each list against wire_logprob value by value: the list builder takes a shortcut when
    # the sum is finite, so sums that overflow (finite terms) or hide one bad term are here.
    finite = [-0.25, -0.0, -1e30, -17.0]
    for values in ([], finite, [-1e308, -1e308, -0.5], [-math.inf, *finite],
                   [*finite, -math.inf, -math.inf]):
        got = wire_logprobs(values)
        assert got == [wire_logprob(v) for v in values] and all(type(v) is float for v in got)
    for bad in (math.nan, math.inf):
        for values in ([bad], [*finite, bad], [-math.inf, bad, -1.0], [math.inf, -math.inf]):
            with pytest.raises(NonFiniteLogprob):
                wire_logprobs(values)


@pytest.mark.parametrize("at", [0, 1, 2, None])
def test_completion_chosen_token_leads_once(level_tokens, at) -> None:
    tok, tb = level_tokens
    ids = [tok.encode(s).ids[0] for s in ("x", "He", "a", " wor")]
    natural = alts(*((t, -0.5 * (i + 1)) for i, t in enumerate(ids[:3])))
    chosen, value = (ids[3], -4.0) if at is None else (ids[at], -0.5 * (at + 1))
    top = top_logprobs_dict(Position(chosen, value, natural), tb)
    expected = [(chosen, value)] + [(a.token_id, a.logprob) for a in natural
                                     if a.token_id != chosen]
    assert list(top.items()) == [(tb.token_string(t), v) for t, v in expected]


def test_completion_natural_mode(level_tokens) -> None:
    tok, tb = level_tokens
    h, w, x = (tok.encode(s).ids[0] for s in ("He", " wor", "x"))
    # Offsets come from the output stream (the detokenizer), not from the test: each token
    # starts where the text decoded so far ends.
    stream = OutputStream(tb)
    generated = [GeneratedToken(0, h, -0.5, alts((h, -0.5), (x, -1.5))),
                 GeneratedToken(1, w, -math.inf, alts((x, -0.1), (h, -0.2)))]
    entries = [e for g in generated for e in stream.push(g).entries]
    entries += stream.finish().entries
    pos = positions(entries)
    out = completion_logprobs(pos, tb)
    assert out["tokens"] == [tb.token_string(h), tb.token_string(w)]
    assert out["token_logprobs"] == [-0.5, -9999.0]
    # Chosen first, then natural alternatives by rank; the chosen token is not repeated.
    assert list(out["top_logprobs"][0].items()) == [(tb.token_string(h), -0.5), ("x", -1.5)]
    assert list(out["top_logprobs"][1]) == [tb.token_string(w), "x", tb.token_string(h)]
    assert out["text_offset"] == [0, len(tok.decode([h]))] == [0, 2]
    Logprobs.model_validate(json.loads(strict_dumps(out)))


def test_completion_collision_keeps_every_id(level_tokens) -> None:
    tok, tb = level_tokens
    lead, cont = tok.token_to_id("ä"), tok.token_to_id("¸")
    assert tb.token_string(lead) == tb.token_string(cont) == "\ufffd"
    # Without a context neither completes a character: both read "" (vLLM's correction).
    top = top_logprobs_dict(Position(lead, -0.1, alts((lead, -0.1), (cont, -0.2))), tb)
    assert top == {"": -0.1, f"token_id:{cont}": -0.2}
    top = top_logprobs_dict(Position(cont, -0.3, alts((lead, -0.1), (cont, -0.3))), tb)
    assert top == {"": -0.3, f"token_id:{lead}": -0.1}


def test_completion_selected_and_token_id_modes(level_tokens) -> None:
    tok, tb = level_tokens
    ids = [tok.encode(s).ids[0] for s in ("x", "He", "a")]
    pos = Position(ids[1], -0.7, alts((ids[2], -3.0), (ids[0], -2.0), (ids[1], -0.7)))
    top = top_logprobs_dict(pos, tb, SELECTED)
    assert list(top) == [tb.token_string(ids[2]), "x", tb.token_string(ids[1])]
    top = top_logprobs_dict(Position(ids[1], -0.7, alts((ids[0], -2.0))), tb, SELECTED)
    assert top == {"x": -2.0}
    out = completion_logprobs([pos], tb, WireMode(selected=True, as_token_ids=True))
    assert out["tokens"] == [f"token_id:{ids[1]}"]
    assert list(out["top_logprobs"][0]) == [f"token_id:{i}" for i in (ids[2], ids[0], ids[1])]
    assert WireMode.for_params(SamplingParams(logprob_token_ids=(1, 2))) == SELECTED
    assert WireMode.for_params(SamplingParams(logprobs=3), as_token_ids=True) == AS_IDS


def test_nan_never_reaches_json(level_tokens) -> None:
    tok, tb = level_tokens
    t = tok.encode("x").ids[0]
    for pos in (Position(t, math.nan), Position(t, -1.0, alts((t, -1.0), (t + 1, math.nan)))):
        with pytest.raises(NonFiniteLogprob):
            completion_logprobs([pos], tb)
        with pytest.raises(NonFiniteLogprob):
            chat_logprobs([pos], tb)


def test_chat_entries_carry_true_bytes(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    lead, cont = tok.token_to_id("<0xE4>"), tok.token_to_id("<0xB8>")
    hello = tok.token_to_id("▁Hello")
    pos = Position(lead, -2.0, alts((hello, -0.5), (cont, -math.inf)))
    entry = chat_token_logprob(pos, tb)
    assert entry["token"] == "" and entry["bytes"] == [0xE4]
    # Natural top-N by rank, the chosen token not inserted.
    assert [(a["token"], a["logprob"], a["bytes"]) for a in entry["top_logprobs"]] == [
        (" Hello", -0.5, list(b" Hello")),
        ("", -9999.0, [0xB8]),
    ]
    # After the two lead bytes of 中 (E4 B8 AD), the token of its last byte reads "中"; an
    # alternative that ends another character after the same bytes reads that one (E4 B8 A9
    # is 丩), and one that leaves it open reads ""; the bytes stay each token's own.
    last, other, open_ = (tok.token_to_id(f"<0x{b:02X}>") for b in (0xAD, 0xA9, 0xE4))
    completing = Position(last, -1.0, alts((last, -1.0), (other, -2.0), (open_, -2.5),
                                           (hello, -3.0)), context=(hello, lead, cont))
    entry = chat_token_logprob(completing, tb)
    assert (entry["token"], entry["bytes"]) == ("中", [0xAD])
    assert [(a["token"], a["bytes"]) for a in entry["top_logprobs"]] == [
        ("中", [0xAD]), ("丩", [0xA9]), ("", [0xE4]), (" Hello", list(b" Hello"))]
    ChatCompletionTokenLogprob.model_validate(json.loads(strict_dumps(entry)))
    entry = chat_token_logprob(pos, tb, AS_IDS)
    assert entry["token"] == f"token_id:{lead}" and entry["bytes"] == [0xE4]
    assert entry["top_logprobs"][0]["token"] == f"token_id:{hello}"


def test_chat_skips_positions_without_logprob(level_tokens) -> None:
    tok, tb = level_tokens
    t = tok.encode("x").ids[0]
    out = chat_logprobs([Position(t, None), Position(t, -1.0)], tb)
    assert len(out["content"]) == 1
    ChoiceLogprobs.model_validate(json.loads(strict_dumps(out)))
    with pytest.raises(ValueError):
        chat_token_logprob(Position(t, None), tb)


def test_echo_prompt_positions(level_tokens) -> None:
    tok, tb = level_tokens
    prompt, generated = tok.encode("Hello 中").ids, tok.encode(" world").ids
    prompt_text, prompt_offsets = detokenize(tb, prompt)
    pos = [Position(prompt[0], None, (), prompt_offsets[0])]
    scored = zip(prompt[1:], prompt_offsets[1:], strict=True)
    pos += [Position(t, -1.0, alts((t, -1.0)), o) for t, o in scored]
    stream = OutputStream(tb, prompt_ids=prompt)
    entries = [e for t in generated for e in stream.push(GeneratedToken(0, t, -0.5)).entries]
    entries += stream.finish().entries
    pos += positions(entries, offset_base=len(prompt_text))
    out = completion_logprobs(pos, tb)
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["token_logprobs"][1:] == [-1.0] * (len(prompt) - 1) + [-0.5] * len(generated)
    full = tok.decode(prompt + generated)
    for token, offset in zip(out["tokens"], out["text_offset"], strict=True):
        if "\ufffd" not in token:
            assert full[offset:].startswith(token)
    # The client's parser (lenient, as in responses) accepts the null first position.
    parsed = construct_type(type_=Logprobs, value=json.loads(strict_dumps(out)))
    assert parsed.token_logprobs[0] is None and parsed.text_offset == out["text_offset"]


def test_streamed_chunks_equal_the_whole_response(fallback_tokens) -> None:
    tok, tb = fallback_tokens
    ids = tok.encode("Hello 中文 日本語 🙂 done STOP tail").ids
    tokens = [
        GeneratedToken(i, t, -0.1 * i, alts((t, -0.1 * i), (3, -math.inf)))
        for i, t in enumerate(ids)
    ]
    stream = OutputStream(tb, ["STOP"], prompt_ids=[1])
    chunks = []
    for token in tokens:
        chunks.append(stream.push(token))
        if stream.done:
            break
    chunks.append(stream.finish())
    streamed = [completion_logprobs(positions(c.entries), tb) for c in chunks]
    whole = completion_logprobs(positions(e for c in chunks for e in c.entries), tb)
    for key in whole:
        assert [x for part in streamed for x in part[key]] == whole[key]
    text = "".join(c.text for c in chunks)
    assert text == "Hello 中文 日本語 🙂 done "
    assert whole["text_offset"] == sorted(whole["text_offset"])
    assert max(whole["text_offset"]) < len(text)
    chat = [chat_logprobs(positions(c.entries), tb) for c in chunks]
    assert sum(len(c["content"]) for c in chat) == len(whole["tokens"])
    for part in chat:
        ChoiceLogprobs.model_validate(json.loads(strict_dumps(part)))
    got = b"".join(bytes(e["bytes"]) for part in chat for e in part["content"])
    assert got.decode().lstrip(" ").startswith(text)


def test_prompt_texts_do_not_depend_on_how_the_prompt_was_chunked(fallback_tokens) -> None:
    """A scored prompt arrives in chunks (and a stream formats each on its own): a position's
    decoded_token takes its context from the prompt itself, so a character split across a
    chunk boundary reads the same in any chunking; position 0 is in no context (vLLM)."""
    tok, tb = fallback_tokens
    prompt = tok.encode("ab 日本語 x").ids  # (日本語: byte pieces, outside the vocabulary)
    assert len(prompt) > 10
    entries = [None] + [PromptLogprob(p, t, -1.0, 1, alts((t, -1.0)))
                        for p, t in enumerate(prompt) if p]

    def texts(items) -> list:
        return [None if i is None else [v["decoded_token"] for v in i.values()] for i in items]

    whole = texts(prompt_logprobs_list(entries, tb, 1, prompt_ids=prompt))
    for cut in range(1, len(entries)):
        parts = (prompt_logprobs_list(entries[:cut], tb, 1, prompt_ids=prompt)
                 + prompt_logprobs_list(entries[cut:], tb, 1, prompt_ids=prompt))
        assert texts(parts) == whole
    decoded = [t[0] for t in whole[1:]]
    assert {"日", "本", "語"} <= set(decoded), decoded
    assert "".join(decoded).endswith("日本語 x"), decoded
