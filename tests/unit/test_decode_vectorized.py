"""The whole-frame decoder equals the position-by-position path on random frames, failures
included (a failing slot is decoded again position by position, which names the failure)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ranks.contract.abi6 import Kind
from ranks.contract.completion import CompletionOutputs, write_record
from runtime.engine.client import TokenLogprob
from runtime.engine.decode import (
    DecodeError,
    LaneExpectation,
    SlotDecode,
    _decode_slot,
    _emitting,
    decode_frame,
)

CAPACITY = 8
T = 4


@pytest.fixture(autouse=True)
def whole_frame(monkeypatch):
    """Small frames decode position by position (FEW_POSITIONS): keep the whole-frame decoder
    under test here, whatever the frame's size."""
    monkeypatch.setattr("runtime.engine.decode.FEW_POSITIONS", 0)
VOCAB = 60
W = 24


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)


def reference(records, payload, expected, vocab_size, submission=None) -> dict[int, SlotDecode]:
    out = {}
    for slot in sorted(expected):
        try:
            emitting = _emitting(slot, records[slot].tolist(), payload[slot], expected[slot],
                                 submission)
        except DecodeError as error:
            out[slot] = SlotDecode(slot, (), error)
            continue
        out[slot] = _decode_slot(slot, payload[slot], expected[slot], emitting, vocab_size)
    return out


def random_frame(rng: np.random.Generator, corrupt: bool):
    frame = CompletionOutputs.allocate(CAPACITY, T).frame(0)
    records, payload = frame.records.numpy(), frame.payload.numpy()
    expected = {}
    for slot in rng.choice(CAPACITY, rng.integers(1, CAPACITY + 1), replace=False).tolist():
        emitted = int(rng.integers(0, T + 1))
        tokens = tuple(int(t) for t in rng.integers(0, VOCAB, emitted))
        kind = Kind.SPECULATIVE if rng.random() < 0.3 else Kind.SAMPLE
        if rng.random() < 0.1:
            kind = Kind.ADMISSION
        forced = int(rng.integers(0, 1 << emitted)) if rng.random() < 0.3 else 0
        write_record(frame.records, slot, epoch=2, ordinal=100 + slot, kind=kind,
                     tokens=tokens, forced_mask=forced)
        if rng.random() < 0.4:
            ids = tuple(rng.choice(VOCAB, int(rng.integers(1, W + 1)), replace=False).tolist())
            lane = LaneExpectation(epoch=2, ordinal=100 + slot, token_ids=ids)
        else:
            lane = LaneExpectation(epoch=2, ordinal=100 + slot, logprobs=int(rng.integers(0, 21)))
        expected[slot] = lane
        for position in range(T):
            values = np.sort(-rng.exponential(3.0, W + 1).astype(np.float32))[::-1]
            values[rng.random(W + 1) < 0.05] = -np.inf
            row = payload[slot, position]
            row[0] = tokens[position] if position < emitted else -1
            row[1] = bits(values[:1])[0]
            chosen_ids = lane.token_ids or tuple(rng.choice(VOCAB, W, replace=False).tolist())
            row[2 : 2 + 2 * len(chosen_ids) : 2] = chosen_ids
            row[3 : 3 + 2 * len(chosen_ids) : 2] = bits(values[1 : 1 + len(chosen_ids)])
            row[2 + 2 * len(chosen_ids) :: 2] = -1
    if corrupt:
        slot = next(iter(expected))
        position = int(rng.integers(0, T))
        word = int(rng.integers(0, 2 + 2 * W))
        choice = rng.random()
        if choice < 0.3:
            payload[slot, position, word] = bits([math.nan])[0]
        elif choice < 0.5:
            payload[slot, position, word] = bits([math.inf])[0]
        elif choice < 0.8:
            payload[slot, position, word] = int(rng.integers(-2, VOCAB + 2))
        else:
            records[slot, 1] = 7  # another epoch: a stale record
    return records, payload, expected


@pytest.mark.parametrize("seed", range(40))
def test_whole_frame_decode_equals_position_by_position(seed):
    rng = np.random.default_rng(seed)
    records, payload, expected = random_frame(rng, corrupt=seed % 2 == 1)
    vocab = VOCAB if seed % 3 else 5
    got = decode_frame(records, payload, expected, vocab)
    want = reference(records, payload, expected, vocab)
    assert list(got) == list(want)
    for slot, result in got.items():
        assert result.entries == want[slot].entries
        assert str(result.error) == str(want[slot].error)
        for entry, expected_entry in zip(result.entries, want[slot].entries, strict=True):
            assert all(type(alt) is TokenLogprob for alt in entry.alternatives)
            assert value_bits(entry) == value_bits(expected_entry)


def value_bits(entry) -> list[int]:
    values = [entry.logprob, *(alt.logprob for alt in entry.alternatives)]
    return bits(values).tolist()


def test_signed_zero_and_subnormals_survive_the_whole_frame_path():
    frame = CompletionOutputs.allocate(2, 2).frame(0)
    write_record(frame.records, 1, epoch=1, ordinal=3, kind=Kind.SAMPLE, tokens=(4,))
    row = frame.payload[1, 0]
    row[0], row[1] = 4, int(bits([-0.0])[0])
    row[2], row[3] = 9, int(bits([-1e-45])[0])
    lane = LaneExpectation(epoch=1, ordinal=3, logprobs=1)
    entry = decode_frame(frame.records, frame.payload[:, :, :4], {1: lane}, 10)[1].entries[0]
    assert entry.logprob == 0.0 and math.copysign(1.0, entry.logprob) == -1.0
    assert entry.alternatives == ((9, float(np.float32(-1e-45))),)
