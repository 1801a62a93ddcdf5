"""The frame decoder against an independent oracle on random frames, corrupt ones included:
the oracle reads the contract's rules word by word with numpy scalars (no list fast paths),
and both must agree on every slot's entries, value bits and whether (and where) it fails."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.abi6 import Kind
from helios_logprobs.ranks.contract.completion import CompletionOutputs, write_record
from helios_logprobs.runtime.engine.decoding.frame import decode_frame
from helios_logprobs.runtime.engine.decoding.lanes import LaneExpectation
from helios_logprobs.runtime.outputs import TokenLogprob

CAPACITY = 8
T = 4
VOCAB = 60
W = 24


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)


def oracle(records, payload, expected, vocab_size, submission=None):
    """slot -> (entries as (position, id, logprob, ((id, logprob), ...)), failed)."""
    out = {}
    for slot, lane in sorted(expected.items()):
        record = records[slot]
        entries: list = []
        failed = False
        emitting = int(record[abi6.KIND]) in (Kind.SAMPLE, Kind.SPECULATIVE, Kind.SCORED_PREFILL)
        if (
            (int(record[abi6.SLOT]), int(record[abi6.EPOCH]), int(record[abi6.REQUEST_ORDINAL]))
            != (slot, lane.epoch, lane.ordinal)
            or (submission is not None and int(record[abi6.SUBMISSION]) != submission)
            or int(record[abi6.KIND]) not in {int(k) for k in Kind}
            or (emitting and not 0 <= int(record[abi6.EMITTED]) <= T)
            or (emitting and lane.pairs > (payload.shape[2] - 2) // 2)
        ):
            out[slot] = ((), True)
            continue
        for position in range(int(record[abi6.EMITTED]) if emitting else 0):
            if (int(record[abi6.FORCED_MASK]) >> position) & 1:
                continue
            token = int(record[abi6.HEADER + position])
            words = payload[slot, position]
            value = float(words[1:2].view(np.float32)[0])
            if lane.token_ids is not None:
                ids = list(lane.token_ids)
            else:
                ids = [int(t) for t in words[2 : 2 + 2 * min(lane.logprobs, vocab_size) : 2]]
            pairs = []
            bad = int(words[0]) != token or math.isnan(value) or value == math.inf
            for j, token_id in enumerate(ids):
                alt = float(words[3 + 2 * j : 4 + 2 * j].view(np.float32)[0])
                bad |= int(words[2 + 2 * j]) != token_id  # selected ids: the caller's order
                bad |= lane.token_ids is None and not 0 <= token_id < vocab_size
                bad |= math.isnan(alt) or alt == math.inf
                pairs.append((token_id, alt))
            if bad:
                failed = True
                break
            entries.append((position, token, value, tuple(pairs)))
        out[slot] = (tuple(entries), failed)
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
        if choice < 0.25:
            payload[slot, position, word] = bits([math.nan])[0]
        elif choice < 0.4:
            payload[slot, position, word] = bits([math.inf])[0]
        elif choice < 0.65:
            payload[slot, position, word] = int(rng.integers(-2, VOCAB + 2))
        elif choice < 0.75:  # the request reads past the copied prefix
            expected[slot] = LaneExpectation(epoch=2, ordinal=100 + slot, logprobs=W + 1)
        else:
            header(records, slot, rng)
    return records, payload, expected


def header(records: np.ndarray, slot: int, rng: np.random.Generator) -> None:
    """One corrupt record field: each is a check the whole-frame path makes on its own."""
    field, value = [
        (abi6.EPOCH, 7),  # another epoch: a stale record
        (abi6.REQUEST_ORDINAL, 999),
        (abi6.SLOT, (slot + 1) % CAPACITY),
        (abi6.SUBMISSION, 12),
        (abi6.KIND, int(rng.choice([-1, 8, 99]))),
        (abi6.EMITTED, int(rng.choice([-1, T + 1]))),
        (abi6.FORCED_MASK, -1),  # every position forced (the sign bit shifts in)
    ][int(rng.integers(0, 7))]
    records[slot, field] = value


@pytest.mark.parametrize("seed", range(80))
def test_frame_decode_equals_the_oracle(seed):
    rng = np.random.default_rng(seed)
    records, payload, expected = random_frame(rng, corrupt=seed % 2 == 1)
    payload = payload[:, :, : 2 + 2 * W]  # the executor's copied prefix
    vocab = VOCAB if seed % 3 else 5
    submission = 5 if seed % 4 < 2 else None
    records[:, abi6.SUBMISSION] = 5
    got = decode_frame(records, payload, expected, vocab, submission=submission)
    want = oracle(records, payload, expected, vocab, submission)
    assert list(got) == list(want)
    for slot, result in got.items():
        entries, failed = want[slot]
        assert result.entries == entries
        assert (not result.ok) == failed, result.error
        for entry, expected_entry in zip(result.entries, entries, strict=True):
            assert all(type(alt) is TokenLogprob for alt in entry.alternatives)
            assert value_bits(entry) == bits([expected_entry[2], *(v for _, v in
                                                                   expected_entry[3])]).tolist()
    if seed % 2 == 0 and vocab == VOCAB:  # a clean frame decodes whole
        assert all(result.ok for result in got.values())


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
