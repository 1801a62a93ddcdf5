"""The frame copy: records always, and for the requesting slots only each position's chosen
pair and first W pairs (consecutive requesting slots are copied as one run)."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.runtime.engine.executor import FrameExecutor, slot_runs

SENTINEL = -12345


@pytest.mark.parametrize("requesting", [[0, 1, 2, 5, 7], [3], [7, 2, 6], [], list(range(8))])
def test_a_copy_holds_the_requesting_slots_prefixes_and_nothing_else(requesting) -> None:
    capacity, tokens, width = 8, 3, 4
    outputs = CompletionOutputs.allocate(capacity, tokens)
    g = torch.Generator().manual_seed(len(requesting))
    outputs.completion_records.copy_(torch.randint(0, 99, outputs.completion_records.shape,
                                                   generator=g))
    outputs.completion_logprobs.copy_(torch.randint(-99, 99, outputs.completion_logprobs.shape,
                                                    generator=g, dtype=torch.int32))
    executor = FrameExecutor(outputs)
    executor.host_payload.fill_(SENTINEL)
    submission = 5
    frame = CompletionOutputs.frame_index(submission)
    host = executor.copy(submission, requesting, width)
    words = 2 + 2 * width
    assert host.frame == frame and host.width == width
    assert (host.records == outputs.completion_records[frame].numpy()).all()
    source = outputs.completion_logprobs[frame].numpy()
    for slot in range(capacity):
        want = source[slot, :, :words] if slot in requesting else SENTINEL
        assert (host.payload[slot] == want).all(), slot
    # The copy fills a contiguous [capacity, T, words] prefix of its pool frame, nothing past
    # it, and nothing in the other pool frame.
    index = host.lease.index
    flat = executor.host_payload[index].reshape(-1)
    assert host.payload.ctypes.data == flat.data_ptr() and host.payload.flags["C_CONTIGUOUS"]
    assert (flat[capacity * tokens * words:] == SENTINEL).all()
    assert (executor.host_payload[1 - index] == SENTINEL).all()
    copied = len(set(requesting))
    assert executor.counters.payload_bytes == (words * 4 * tokens * copied if copied else 0)


def test_slot_runs_group_consecutive_slots() -> None:
    assert slot_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    assert slot_runs([7, 2, 3]) == [(7, 8), (2, 4)]
    assert slot_runs([]) == []
