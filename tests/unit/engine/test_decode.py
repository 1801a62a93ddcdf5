from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helios_logprobs.ranks.contract.abi6 import Kind
from helios_logprobs.ranks.contract.completion import CompletionOutputs, write_record
from helios_logprobs.runtime.engine.decoding.frame import decode_frame
from helios_logprobs.runtime.engine.decoding.lanes import DecodedEntry, DecodeError, LaneExpectation
from helios_logprobs.runtime.outputs import EngineError

CAPACITY = 4
T = 4

VOCAB = 50
W = 20


def fp32_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


def bits_fp32(bits: int) -> float:
    return float(np.array([bits], dtype=np.int32).view(np.float32)[0])


class Frame:
    def __init__(self) -> None:
        frame = CompletionOutputs.allocate(CAPACITY, T).frame(0)
        self.records, self.payload = frame.records, frame.payload

    def record(self, slot, tokens, *, epoch=1, ordinal=10, kind=Kind.SAMPLE, **fields):
        write_record(
            self.records, slot, epoch=epoch, ordinal=ordinal, kind=kind, tokens=tokens, **fields
        )

    def position(self, slot, position, chosen_id, chosen_bits, pairs=()):
        row = self.payload[slot, position]
        row[0], row[1] = chosen_id, chosen_bits
        for j, (token_id, bits) in enumerate(pairs):
            row[2 + 2 * j], row[3 + 2 * j] = token_id, bits

    def natural(self, slot, position, chosen_id, value, count=5):
        pairs = [(i, fp32_bits(-1.0 - i)) for i in range(count)]
        self.position(slot, position, chosen_id, fp32_bits(value), pairs)

    def decode(self, expected, width=W, vocab_size=VOCAB, **kwargs):
        prefix = self.payload[:, :, : 2 + 2 * width]
        return decode_frame(self.records.clone(), prefix, expected, vocab_size, **kwargs)


def natural_lane(n=5, epoch=1, ordinal=10) -> LaneExpectation:
    return LaneExpectation(epoch=epoch, ordinal=ordinal, logprobs=n)


def test_fp32_bits_are_restored_exactly():
    patterns = [
        fp32_bits(-0.0),
        fp32_bits(-math.inf),
        np.int32(-(2**31) + 1),
        fp32_bits(-1e-39),
        fp32_bits(-3.1415927),
        fp32_bits(-88.72284),
    ]
    frame = Frame()
    frame.record(0, (7,))
    pairs = [(i + 1, int(bits)) for i, bits in enumerate(patterns)]
    frame.position(0, 0, 7, fp32_bits(-0.0), pairs)
    entry = frame.decode({0: natural_lane(n=len(patterns))})[0].entries[0]
    assert entry.logprob == 0.0 and math.copysign(1.0, entry.logprob) == -1.0
    assert [token_id for token_id, _ in entry.alternatives] == [1, 2, 3, 4, 5, 6]
    restored = [fp32_bits(value) for _, value in entry.alternatives]
    assert restored == [int(bits) for bits in patterns]
    assert entry.alternatives[1][1] == -math.inf
    assert entry.alternatives[2][1] == bits_fp32(-(2**31) + 1) == -1.401298464324817e-45


def test_entries_follow_emitted_order_and_skip_forced_positions():
    frame = Frame()
    frame.record(1, (11, 12, 13), forced_mask=0b010)
    for position, token in enumerate((11, 12, 13)):
        frame.natural(1, position, token, -0.25 * (position + 1))
    result = frame.decode({1: natural_lane(n=2)})[1]
    assert result.ok
    assert [(e.position, e.token_id, e.logprob) for e in result.entries] == [
        (0, 11, -0.25),
        (2, 13, -0.75),
    ]
    assert result.entries[0].alternatives == ((0, -1.0), (1, -2.0))


def test_natural_mode_trims_to_n():
    frame = Frame()
    frame.record(0, (3,))
    frame.natural(0, 0, 3, -0.5, count=20)
    entry = frame.decode({0: natural_lane(n=3)})[0].entries[0]
    assert entry == DecodedEntry(0, 3, -0.5, ((0, -1.0), (1, -2.0), (2, -3.0)))


def test_natural_mode_with_zero_alternatives_reports_the_chosen_token():
    frame = Frame()
    frame.record(0, (3,))
    frame.natural(0, 0, 3, -0.5, count=0)
    assert frame.decode({0: natural_lane(n=0)})[0].entries == (DecodedEntry(0, 3, -0.5, ()),)


def test_small_vocabulary_reports_only_existing_alternatives():
    frame = Frame()
    frame.record(0, (1,))
    frame.natural(0, 0, 1, -0.1, count=2)
    entry = frame.decode({0: natural_lane(n=5)}, vocab_size=2)[0].entries[0]
    assert entry.alternatives == ((0, -1.0), (1, -2.0))


def test_missing_natural_alternative_fails_the_request():
    frame = Frame()
    frame.record(0, (1,))
    frame.natural(0, 0, 1, -0.1, count=2)
    result = frame.decode({0: natural_lane(n=3)})[0]
    assert isinstance(result.error, DecodeError)
    assert result.error.slot == 0
    assert "position 0: natural alternative 2 missing (id -1), expected 3" in str(result.error)


def test_selected_mode_returns_every_id_in_caller_order_from_a_short_prefix():
    ids = tuple(range(49, 19, -1))
    frame = Frame()
    frame.record(2, (5,), epoch=3, ordinal=4)
    frame.position(2, 0, 5, fp32_bits(-2.0), [(t, fp32_bits(-t / 8)) for t in ids])
    lane = LaneExpectation(epoch=3, ordinal=4, token_ids=ids)
    entry = frame.decode({2: lane}, width=30)[2].entries[0]
    assert entry.alternatives == tuple((t, -t / 8) for t in ids)


def test_selected_ids_out_of_order_fail_the_request():
    frame = Frame()
    frame.record(0, (5,))
    frame.position(0, 0, 5, fp32_bits(-2.0), [(8, 0), (7, 0)])
    lane = LaneExpectation(epoch=1, ordinal=10, token_ids=(7, 8))
    error = frame.decode({0: lane})[0].error
    assert "selected ids missing or out of order at (index, id) [(0, 7), (1, 8)]" in str(error)


def test_missing_selected_id_fails_the_request():
    frame = Frame()
    frame.record(0, (5,))
    frame.position(0, 0, 5, fp32_bits(-2.0), [(7, 0)])
    lane = LaneExpectation(epoch=1, ordinal=10, token_ids=(7, 8))
    assert "at (index, id) [(1, 8)]" in str(frame.decode({0: lane})[0].error)


def test_mismatched_chosen_id_fails_only_that_request():
    frame = Frame()
    frame.record(0, (9,))
    frame.natural(0, 0, 8, -0.5)
    frame.record(1, (9,))
    frame.natural(1, 0, 9, -0.5)
    results = frame.decode({0: natural_lane(), 1: natural_lane()})
    assert results[0].error is not None and results[0].entries == ()
    assert "position 0: payload chosen id 8, emitted token 9" in str(results[0].error)
    assert results[1].ok and results[1].entries[0].token_id == 9


def test_error_stops_the_requests_later_tokens_in_the_frame():
    frame = Frame()
    frame.record(0, (4, 5, 6))
    frame.natural(0, 0, 4, -0.5)
    frame.natural(0, 1, 5, math.nan)
    frame.natural(0, 2, 6, -0.5)
    result = frame.decode({0: natural_lane()})[0]
    assert [entry.position for entry in result.entries] == [0]
    assert "position 1: chosen token 5: non-finite logprob nan" in str(result.error)


def test_nan_alternative_fails_the_request():
    frame = Frame()
    frame.record(0, (4,))
    frame.position(0, 0, 4, fp32_bits(-0.5), [(1, fp32_bits(math.nan))])
    error = frame.decode({0: natural_lane(n=1)})[0].error
    assert "position 0: alternatives: non-finite logprob nan" in str(error)


def test_positive_infinity_fails_the_request():
    frame = Frame()
    frame.record(0, (4,))
    frame.natural(0, 0, 4, math.inf)
    assert "non-finite logprob inf" in str(frame.decode({0: natural_lane()})[0].error)


def test_stale_epoch_never_decodes():
    frame = Frame()
    frame.record(0, (4,), epoch=1)
    frame.natural(0, 0, 4, -0.5)
    result = frame.decode({0: natural_lane(epoch=2)})[0]
    assert result.entries == ()
    assert "stale record: (slot, epoch, ordinal) (0, 1, 10), scheduler expects (0, 2, 10)" in str(
        result.error
    )


def test_stale_ordinal_never_decodes():
    frame = Frame()
    frame.record(0, (4,), ordinal=10)
    frame.natural(0, 0, 4, -0.5)
    assert "scheduler expects (0, 1, 11)" in str(
        frame.decode({0: natural_lane(ordinal=11)})[0].error
    )


def test_record_of_another_slot_never_decodes():
    frame = Frame()
    frame.record(0, (4,))
    frame.records[1] = frame.records[0]
    frame.natural(1, 0, 4, -0.5)
    assert "(0, 1, 10), scheduler expects (1, 1, 10)" in str(
        frame.decode({1: natural_lane()})[1].error
    )


def test_record_of_another_submission_never_decodes():
    frame = Frame()
    frame.record(0, (4,), submission=3)
    frame.natural(0, 0, 4, -0.5)
    assert frame.decode({0: natural_lane()}, submission=3)[0].ok
    error = frame.decode({0: natural_lane()}, submission=5)[0].error
    assert "stale record: submission 3, expected 5" in str(error)


@pytest.mark.parametrize(
    "kind", [Kind.NONE, Kind.ADMISSION, Kind.MAINTENANCE, Kind.VISION, Kind.INVALID]
)
def test_record_only_rounds_decode_to_no_entries_despite_stale_payload(kind):
    frame = Frame()
    frame.record(0, (4, 5), kind=kind)
    frame.natural(0, 0, 77, math.nan)
    result = frame.decode({0: natural_lane()})[0]
    assert result.ok and result.entries == ()


@pytest.mark.parametrize("kind", [Kind.SPECULATIVE, Kind.SCORED_PREFILL])
def test_other_emitting_kinds_decode(kind):
    frame = Frame()
    frame.record(0, (4, 5), kind=kind)
    frame.natural(0, 0, 4, -0.5)
    frame.natural(0, 1, 5, -1.5)
    assert [e.logprob for e in frame.decode({0: natural_lane()})[0].entries] == [-0.5, -1.5]


def test_unknown_record_kind_fails_the_request():
    frame = Frame()
    frame.record(0, (4,))
    frame.records[0, 3] = 99
    assert "record kind 99 is not an ABI6 kind" in str(frame.decode({0: natural_lane()})[0].error)


def test_emitted_count_beyond_t_fails_the_request():
    frame = Frame()
    frame.record(0, (4,))
    frame.records[0, 4] = T + 1
    assert f"record emits {T + 1} tokens, T={T}" in str(frame.decode({0: natural_lane()})[0].error)


def test_request_reading_past_the_copied_prefix_fails():
    frame = Frame()
    frame.record(0, (4,))
    frame.natural(0, 0, 4, -0.5)
    lane = LaneExpectation(epoch=1, ordinal=10, token_ids=tuple(range(25)))
    error = frame.decode({0: lane}, width=20)[0].error
    assert "payload prefix holds 20 pairs, the request reads 25" in str(error)


def test_slots_outside_the_request_mask_are_never_read():
    frame = Frame()
    frame.records[1].fill_(-7)
    frame.record(2, (4,))
    frame.natural(2, 0, 4, -0.5)
    results = frame.decode({2: natural_lane()})
    assert list(results) == [2] and results[2].ok


def test_numpy_host_copies_decode_like_tensors():
    frame = Frame()
    frame.record(0, (4,))
    frame.natural(0, 0, 4, -0.5)
    prefix = np.ascontiguousarray(frame.payload[:, :, :42].numpy())
    result = decode_frame(frame.records.numpy(), prefix, {0: natural_lane(n=1)}, VOCAB)
    assert result[0].entries == (DecodedEntry(0, 4, -0.5, ((0, -1.0),)),)


def test_decode_error_is_an_engine_error():
    error = DecodeError(3, "boom")
    assert isinstance(error, EngineError)
    assert (error.slot, error.message, str(error)) == (3, "boom", "slot 3: boom")


def test_payload_with_other_token_capacity_is_refused():
    frame = Frame()
    with pytest.raises(ValueError, match=r"payload: expected \[4, 4, 2\+2W\], got \[4, 3, 42\]"):
        decode_frame(frame.records, frame.payload[:, :3, :42], {}, VOCAB)


def test_records_with_wrong_dtype_are_refused():
    frame = Frame()
    with pytest.raises(ValueError, match="records: expected a int64 array, got int32"):
        decode_frame(frame.records.to(torch.int32), frame.payload, {}, VOCAB)


def test_expected_slot_outside_capacity_is_refused():
    frame = Frame()
    with pytest.raises(ValueError, match="slot: expected 0..3, got 4"):
        decode_frame(frame.records, frame.payload, {4: natural_lane()}, VOCAB)


def test_lane_expectation_requires_a_request():
    with pytest.raises(ValueError, match="a requesting lane needs logprobs or token_ids"):
        LaneExpectation(epoch=1, ordinal=1)
