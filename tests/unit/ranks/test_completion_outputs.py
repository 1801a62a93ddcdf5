from __future__ import annotations

import dataclasses

import pytest
import torch

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.completion import CompletionOutputs, write_record
from helios_logprobs.ranks.contract.declarations import CoreDeclarations, GraphDecl, validate

BUFFERS = (
    "completion_records",
    "completion_logprobs",
    "logprob_requested",
    "logprob_token_ids",
    "logprob_token_id_counts",
)


@pytest.mark.parametrize(("requested", "resolved"), [(None, 8), (0, 8), (5, 5), (8, 8)])
def test_allocate_resolves_token_capacity_and_builds_the_complete_bundle(requested, resolved):
    outputs = CompletionOutputs.allocate(3, requested)
    assert outputs.capacity == 3
    assert outputs.token_capacity == resolved
    expected = {
        "completion_records": (torch.int64, (2, 3, 16 + resolved)),
        "completion_logprobs": (torch.int32, (2, 3, resolved, PAYLOAD_WORDS)),
        "logprob_requested": (torch.int32, (3,)),
        "logprob_token_ids": (torch.int32, (3, MAX_TOKEN_IDS)),
        "logprob_token_id_counts": (torch.int32, (3,)),
    }
    tensors = outputs.tensors()
    assert tuple(tensors) == BUFFERS
    for name, (dtype, shape) in expected.items():
        assert tensors[name].dtype == dtype, name
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].is_contiguous(), name
        assert tensors[name].device == torch.device("cpu")


def test_allocate_initialises_records_zero_payload_minus_one():
    outputs = CompletionOutputs.allocate(2, 4)
    assert torch.all(outputs.completion_records == 0)
    assert torch.all(outputs.completion_logprobs == -1)
    assert torch.all(outputs.logprob_requested == 0)
    assert torch.all(outputs.logprob_token_ids == -1)
    assert torch.all(outputs.logprob_token_id_counts == 0)


def test_allocate_refuses_negative_token_capacity():
    with pytest.raises(ValueError, match="completion_token_capacity.*-1"):
        CompletionOutputs.allocate(2, -1)


def test_allocate_refuses_non_positive_capacity():
    with pytest.raises(ValueError, match="capacity: expected a positive int, got 0"):
        CompletionOutputs.allocate(0)


def test_frames_are_views_of_the_bundle():
    outputs = CompletionOutputs.allocate(2, 3)
    frame = outputs.frame(CompletionOutputs.frame_index(7))
    assert tuple(frame.records.shape) == (2, 19)
    assert tuple(frame.payload.shape) == (2, 3, PAYLOAD_WORDS)
    frame.records[1, abi6.EPOCH] = 9
    frame.payload[0, 2, 0] = 42
    assert outputs.completion_records[1, 1, abi6.EPOCH] == 9
    assert outputs.completion_logprobs[1, 0, 2, 0] == 42
    assert torch.all(outputs.completion_records[0] == 0)


def test_frame_index_is_submission_parity():
    assert [CompletionOutputs.frame_index(s) for s in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="submission: expected >= 0"):
        CompletionOutputs.frame_index(-1)


def test_frame_refuses_an_index_outside_the_two_frames():
    with pytest.raises(ValueError, match="frame index: expected 0 or 1, got 2"):
        CompletionOutputs.allocate(1).frame(2)


def test_nbytes_counts_every_buffer_once():
    outputs = CompletionOutputs.allocate(4, 5)
    expected = 2 * 4 * 21 * 8 + 2 * 4 * 5 * PAYLOAD_WORDS * 4 + 4 * 4 + 4 * 128 * 4 + 4 * 4
    assert outputs.nbytes == expected


def test_declarations_validate_as_k20_with_token_ids():
    outputs = CompletionOutputs.allocate(4, None)
    decl = CoreDeclarations(
        buffers=outputs.declarations(),
        graphs=(GraphDecl("decode", "sampling", BUFFERS[2:], BUFFERS[:2]),),
    )
    assert [(b.name, b.dtype, b.shape) for b in decl.buffers][:2] == [
        ("completion_records", "int64", (2, 4, 24)),
        ("completion_logprobs", "int32", (2, 4, 8, 258)),
    ]
    capabilities = validate(decl, capacity=4, token_capacity=0)
    assert (capabilities.k, capabilities.supports_token_ids) == (20, True)


def test_bundle_refuses_a_wrong_dtype():
    outputs = CompletionOutputs.allocate(2, 2)
    with pytest.raises(ValueError, match=r"logprob_requested: expected torch.int32 \[2\]"):
        dataclasses.replace(outputs, logprob_requested=torch.zeros(2, dtype=torch.int64))


def test_bundle_refuses_a_mismatched_slot_count():
    outputs = CompletionOutputs.allocate(2, 2)
    with pytest.raises(ValueError, match=r"logprob_token_id_counts: expected torch.int32 \[2\]"):
        dataclasses.replace(outputs, logprob_token_id_counts=torch.zeros(3, dtype=torch.int32))


def test_bundle_refuses_non_contiguous_storage():
    outputs = CompletionOutputs.allocate(2, 2)
    strided = torch.zeros(128, 2, dtype=torch.int32).t()
    with pytest.raises(ValueError, match="logprob_token_ids: expected contiguous row-major"):
        dataclasses.replace(outputs, logprob_token_ids=strided)


def test_write_record_places_fields_at_the_named_indices():
    records = CompletionOutputs.allocate(3, 4).frame(1).records
    records[2].fill_(77)
    write_record(
        records,
        2,
        epoch=5,
        ordinal=11,
        kind=abi6.Kind.SPECULATIVE,
        tokens=(31, 32),
        forced_mask=0b10,
        offered=3,
        accepted=1,
        finish_reason=abi6.FinishReason.EOS,
        sequence_length=40,
        submission=9,
        first_logit_row=6,
    )
    row = records[2]
    assert int(row[abi6.SLOT]) == 2
    assert int(row[abi6.EPOCH]) == 5
    assert int(row[abi6.REQUEST_ORDINAL]) == 11
    assert int(row[abi6.KIND]) == abi6.Kind.SPECULATIVE
    assert abi6.emitted_tokens(row) == [31, 32]
    assert not abi6.is_forced(row, 0) and abi6.is_forced(row, 1)
    assert int(row[abi6.OFFERED]) == 3 and int(row[abi6.ACCEPTED]) == 1
    assert int(row[abi6.FINISH_REASON]) == abi6.FinishReason.EOS
    assert int(row[abi6.SEQUENCE_LENGTH]) == 40
    assert int(row[abi6.SUBMISSION]) == 9
    assert int(row[abi6.FIRST_LOGIT_ROW]) == 6
    assert all(int(row[i]) == 0 for i in abi6.RESERVED)
    assert row[abi6.HEADER + 2 :].tolist() == [0, 0]
    assert torch.all(records[:2] == 0)


def test_write_record_refuses_more_tokens_than_t():
    records = CompletionOutputs.allocate(1, 2).frame(0).records
    with pytest.raises(ValueError, match="tokens: at most T=2, got 3"):
        write_record(records, 0, epoch=1, ordinal=1, kind=abi6.Kind.SAMPLE, tokens=(1, 2, 3))


def test_write_record_refuses_forced_bits_past_the_emitted_prefix():
    records = CompletionOutputs.allocate(1, 2).frame(0).records
    with pytest.raises(ValueError, match="forced_mask 0x2 marks positions past 1 tokens"):
        write_record(
            records, 0, epoch=1, ordinal=1, kind=abi6.Kind.SAMPLE, tokens=(4,), forced_mask=2
        )


def test_write_record_refuses_a_slot_outside_capacity():
    records = CompletionOutputs.allocate(2, 2).frame(0).records
    with pytest.raises(ValueError, match="slot: expected 0..1, got 2"):
        write_record(records, 2, epoch=1, ordinal=1, kind=abi6.Kind.SAMPLE)
