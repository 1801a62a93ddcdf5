"""The engine core <-> API server messages: every engine event, packed as the core packs it
(token rows of one or more frames' arrays, prompt score arrays), survives StepPacker ->
collectives.codec -> unpack unchanged (FP32 values bit for bit, -inf, forced tokens without a
logprob, every `last` state, a finish's scored stop entry, errors, prompt scores), every
message type round-trips, and malformed bytes are refused."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest

from helios_logprobs.collectives.codec import CodecError, decode, encode
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.engine.frame_tokens import FrameTokens
from helios_logprobs.runtime.engine.prompt_reader import PromptArrays
from helios_logprobs.runtime.frontend.messages import (
    Abort,
    CoreStats,
    Hello,
    Ready,
    Shutdown,
    StepOutputs,
    Submit,
    Welcome,
)
from helios_logprobs.runtime.frontend.packing import StepPacker, unpack
from helios_logprobs.runtime.outputs import (
    EngineError,
    Finished,
    GeneratedToken,
    PromptLogprob,
    PromptScores,
    TokenLogprob,
    TokenLogprobs,
)
from helios_logprobs.runtime.text.reasoning import ReasoningStrings, ReasoningTokens

STATS = CoreStats(True, 2, 3, 0.25, {"frames_copied": 7})


def fp32(x: float) -> float:
    """A float that is exactly an FP32 value (what the engine decodes)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def random_events(rng: np.random.Generator) -> list[tuple[int, object]]:
    events: list[tuple[int, object]] = []
    smallest = struct.unpack("<f", struct.pack("<I", 1))[0]  # the FP32 denormal 2^-149
    specials = [-math.inf, -0.0, smallest, fp32(-1e-30), fp32(-88.7)]
    for request_id in (3, 11, 2**40):
        k = int(rng.integers(0, 21))
        events.append((request_id, PromptScores(tuple(
            PromptLogprob(p, int(rng.integers(0, 151936)), fp32(-rng.exponential()),
                          int(rng.integers(1, 10**6)),
                          tuple(TokenLogprob(int(rng.integers(0, 151936)),
                                             fp32(-rng.exponential())) for _ in range(k)))
            for p in range(1, 4)))))
        for index in range(5):
            alternatives = TokenLogprobs(
                [int(i) for i in rng.integers(0, 151936, size=k)],
                [specials[j % len(specials)] if j < 2 else fp32(-rng.exponential())
                 for j in range(k)])
            forced = index == 2
            events.append((request_id, GeneratedToken(
                index, int(rng.integers(0, 151936)),
                None if forced else specials[index % len(specials)],
                () if forced else alternatives, (None, False, True)[index % 3])))
    events.append((3, Finished("length")))
    events.append((11, Finished("stop", 2, GeneratedToken(5, 2, fp32(-0.5),
                                                          TokenLogprobs([2, 9], [fp32(-0.5),
                                                                                 -math.inf]),
                                                          True))))
    events.append((2**40, EngineError("request failed: non-finite logprob")))
    return events


def same(a, b) -> bool:
    """Equal, with floats compared bit for bit (-0.0 is not 0.0)."""
    if isinstance(a, EngineError):
        return isinstance(b, EngineError) and str(a) == str(b)
    if isinstance(a, float):
        return isinstance(b, float) and struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, TokenLogprobs | tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def pack(events: list[tuple[int, object]], frames: int = 2) -> StepPacker:
    """The engine's way: each request's tokens as a row range of one frame's arrays (requests
    spread over ``frames`` frames, in reverse order of their rows), the rest as events."""
    packer = StepPacker()
    requests = list(dict.fromkeys(r for r, _ in events))
    for part in range(frames):
        mine = requests[part::frames]
        tokens = [(r, e) for r, e in events if r in mine and isinstance(e, GeneratedToken)]
        frame = FrameTokens.of([e for _, e in tokens])
        for request_id in reversed(mine):
            rows = [i for i, (r, _) in enumerate(tokens) if r == request_id]
            packer.add_rows(request_id, frame, rows[0], rows[-1] + 1)
    for request_id, event in events:
        if isinstance(event, PromptScores):
            packer.add_prompt(request_id, prompt_arrays(event))
        elif not isinstance(event, GeneratedToken):
            packer.add(request_id, event)
    return packer


def prompt_arrays(scores: PromptScores) -> PromptArrays:
    entries = scores.entries
    alternatives = [a for e in entries for a in e.alternatives]
    return PromptArrays(
        np.array([e.position for e in entries], dtype=np.int64),
        np.array([e.token_id for e in entries], dtype=np.int32),
        np.array([e.logprob for e in entries], dtype=np.float32),
        np.array([e.rank for e in entries], dtype=np.int64),
        np.array([len(e.alternatives) for e in entries], dtype=np.int32),
        np.array([a.token_id for a in alternatives], dtype=np.int32),
        np.array([a.logprob for a in alternatives], dtype=np.float32))


@pytest.mark.parametrize(("seed", "frames"), [(0, 1), (1, 2), (2, 3)])
def test_a_steps_events_survive_the_wire(seed, frames):
    events = random_events(np.random.default_rng(seed))
    packer = pack(events, frames)
    message = decode(encode(packer.take(STATS)))
    assert isinstance(message, StepOutputs) and message.stats == STATS
    got = list(unpack(message))
    # Per request, the same events in the same order (requests interleave differently).
    for request_id in {r for r, _ in events}:
        want = [e for r, e in events if r == request_id]
        have = [e for r, e in got if r == request_id]
        assert same(want, have), (request_id, want, have)
    assert not packer  # take() emptied it


def test_the_values_cross_as_fp32_arrays_not_objects():
    packer = pack([(1, GeneratedToken(0, 5, fp32(-1.5),
                                      TokenLogprobs([5, 6], [fp32(-1.5), -2.0])))])
    out = packer.take(STATS)
    assert out.values.dtype == np.float32 and out.alt_values.dtype == np.float32
    assert out.alt_ids.dtype == np.int32 and out.alt_counts.tolist() == [2]


def test_every_message_round_trips():
    info = EngineInfo("m", 151936, 4096, 20, True, (2, 7), True,
                      ReasoningTokens((10, 11), (12,), ReasoningStrings("<think>", "</think>")))
    params = SamplingParams(max_tokens=9, temperature=0.0, logprobs=20, stop_token_ids=(3,),
                            logit_bias=((4, -1.5),), bad_words=((1, 2),), seed=2**63 - 1)
    messages = [Hello(0), Ready(1, 8000), Shutdown("SIGTERM"), Abort(2, (1, 2, 3)),
                Submit(0, 7, np.array([1, 2, 151935], dtype=np.int64), params),
                Welcome(info, 16, 1024, {"completion": 1, "scored": 0, "host": 2}, STATS)]
    for message in messages:
        back = decode(encode(message))
        if isinstance(message, Submit):
            assert back.prompt_ids.tolist() == [1, 2, 151935] and back.params == params
        else:
            assert back == message


def test_malformed_messages_are_refused():
    good = encode(Abort(0, (1,)))
    with pytest.raises(CodecError):
        decode(good[:-1])
    with pytest.raises(CodecError):
        decode(good + b"\x00")
    with pytest.raises(CodecError):  # a bare msgpack value, not a message
        decode(msgpack.packb([1, 2]))
    bad = object.__new__(Hello)  # (built around its check, as a foreign sender could)
    object.__setattr__(bad, "index", -1)
    with pytest.raises(CodecError, match="index"):  # a field the message's check refuses
        decode(encode(bad))
    out = pack([(1, GeneratedToken(0, 5, -1.0, TokenLogprobs([5], [-1.0])))]).take(STATS)
    with pytest.raises(ValueError):  # counts that do not add up
        StepOutputs(out.request_ids, out.indexes, out.token_ids, out.values, out.last,
                    out.alt_counts + 1, out.alt_ids, out.alt_values, (), (), STATS)
