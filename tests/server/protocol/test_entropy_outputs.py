"""return_entropy's FP32 values through the engine core -> API server arrays: a step whose
frames mix tokens with and without entropy (two frames, one API server taking rows of both,
out of order) packs, crosses the codec and unpacks into events equal to the GeneratedTokens
it started from, entropy bits included; a step without entropy sends no entropy column."""

from __future__ import annotations

import numpy as np

from helios_logprobs.collectives.codec import decode, encode
from helios_logprobs.runtime.engine.frame_tokens import FrameTokens
from helios_logprobs.runtime.frontend.messages import CoreStats, StepOutputs
from helios_logprobs.runtime.frontend.packing import StepPacker, unpack
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, TokenLogprobs

STATS = CoreStats(True, 0, 2, 0.0)
RNG = np.random.default_rng(38)


def fp32(value: float) -> float:
    return float(np.float32(value))


def token(index: int, entropy: float | None, alternatives: int = 2) -> GeneratedToken:
    ids = RNG.integers(0, 300, alternatives).tolist()
    values = [fp32(v) for v in -RNG.random(alternatives) * 5]
    return GeneratedToken(index, int(RNG.integers(0, 300)), fp32(-RNG.random()),
                          TokenLogprobs(ids, values), False, entropy)


def crossed(outputs: StepOutputs) -> list:
    return list(unpack(decode(encode(outputs))))


def test_mixed_frames_keep_every_entropy_bit():
    tiny = float(np.nextafter(np.float32(0), np.float32(1)))  # (the smallest FP32 subnormal)
    with_entropy = [token(0, fp32(2.718281828)), token(1, tiny), token(0, fp32(5.5))]
    without = [token(3, None), token(4, None)]
    first, second = FrameTokens.of(with_entropy), FrameTokens.of(without)
    assert first.entropy is not None and second.entropy is None
    packer = StepPacker()
    packer.add_rows(7, first, 0, 2)
    packer.add_rows(9, second, 0, 2)
    packer.add_rows(8, first, 2, 3)
    entry = token(5, fp32(0.125))
    packer.add(8, Finished("stop", entry.token_id, entry))
    outputs = packer.take(STATS)
    assert outputs.entropy is not None and outputs.entropy.dtype == np.float32
    events = crossed(outputs)
    assert events == [(7, with_entropy[0]), (7, with_entropy[1]), (9, without[0]),
                      (9, without[1]), (8, with_entropy[2]),
                      (8, Finished("stop", entry.token_id, entry))]
    assert events[1][1].entropy == tiny and events[2][1].entropy is None


def test_a_step_without_entropy_sends_no_column():
    packer = StepPacker()
    tokens = [token(0, None), token(1, None)]
    packer.add_rows(1, FrameTokens.of(tokens), 0, 2)
    outputs = packer.take(STATS)
    assert outputs.entropy is None
    assert crossed(outputs) == [(1, tokens[0]), (1, tokens[1])]
