"""The frame transfer on the CPU (issue 36): FrameExecutor copies a served step's frame into a
leased pool frame (records, and for the requesting slots only the chosen pair and the first W
pairs, bit-equal to the eager payload the reduction wrote), decoding releases it, a full pool
refuses a copy instead of reusing a frame still being decoded, and after warm-up no copy
creates tensor storage. tests/gpu/test_captured_step_gpu.py checks the CUDA streams and
events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helios_logprobs.kernels.layout import FIRST_PAIR
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.engine.executor import FrameExecutor
from helios_logprobs.runtime.engine.frames import FramePoolExhausted
from helios_logprobs.runtime.outputs import GeneratedToken
from tests.capacity_checks import reachable_storages
from tests.capture_guard import allocated_bytes
from tests.checkpoints import write_llama

WARM_UP = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


def jobs() -> list[tuple[list[int], SamplingParams]]:
    """Plain lanes beside K=3, K=20 and 30 selected ids (wider than K): copies of every width,
    and frames with no requesting lane once the requesting requests end."""
    def params(tokens: int, **extra) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)

    return [([5, 6, 7], params(24)), ([8, 9], params(6, logprobs=3)),
            ([4, 5], params(9, logprob_token_ids=tuple(range(100, 130)))),
            ([3, 1, 4, 1, 5], params(12, logprobs=20)), ([2, 7], params(16))]


def test_served_frames_copy_the_eager_prefixes_into_pooled_storage(model_dir):
    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=64)
    engine = build_engine(config, load_rank(config, None))
    executor, outputs = engine.executor, engine.step.outputs
    pool = executor.pool
    copy = executor.copy
    copies: list[tuple[int, int, int, int]] = []  # (requesting, width, allocated bytes, frame)
    storage = pool.payload.untyped_storage()
    low, high = storage.data_ptr(), storage.data_ptr() + storage.nbytes()

    def checked(submission, requesting, width, entropy=False):
        assert pool.leased() == []  # the previous frame went back to the pool once decoded
        host, allocated = allocated_bytes(lambda: copy(submission, requesting, width, entropy))
        frame, words = host.frame, FIRST_PAIR + 2 * width
        assert host.lease.submission == submission and not host.lease.released
        assert np.array_equal(host.records, outputs.completion_records[frame].numpy())
        eager = outputs.completion_logprobs[frame].numpy()
        for slot in requesting:
            assert host.payload[slot].tobytes() == eager[slot, :, :words].tobytes(), slot
        assert host.payload.flags["C_CONTIGUOUS"] and host.payload.shape[-1] == words
        assert low <= host.payload.ctypes.data < high
        copies.append((len(requesting), width, allocated, host.lease.index))
        return host

    executor.copy = checked
    storages = reachable_storages(executor)
    results = engine.run_offline(jobs())
    assert pool.leased() == []
    for events in results:
        tokens = [e for e in events if isinstance(e, GeneratedToken)]
        assert tokens and tokens[-1].index == len(tokens) - 1
    wanting = [c for c in copies if c[0]]
    assert len(copies) > 20 and len(wanting) > 5 and len(wanting) < len(copies)
    assert {width for _, width, _, _ in wanting} >= {20, 30}
    assert {index for *_, index in copies} == set(range(pool.frames))
    counters = executor.counters
    assert counters.frames == len(copies) and counters.payload_copies == len(wanting)
    token_capacity = outputs.token_capacity
    assert counters.payload_bytes == sum(n * token_capacity * (FIRST_PAIR + 2 * w) * 4
                                         for n, w, _, _ in wanting)
    assert [allocated for _, _, allocated, _ in copies[WARM_UP:]] == [0] * (
        len(copies) - WARM_UP)
    assert reachable_storages(executor) == storages
    stats = pool.stats()
    assert stats.acquired == stats.released == len(copies) and stats.exhausted == 0


def outputs_with_values(capacity: int = 4, tokens: int = 3) -> CompletionOutputs:
    outputs = CompletionOutputs.allocate(capacity, tokens)
    g = torch.Generator().manual_seed(1)
    outputs.completion_records.copy_(torch.randint(0, 99, outputs.completion_records.shape,
                                                   generator=g))
    outputs.completion_logprobs.copy_(torch.randint(
        -99, 99, outputs.completion_logprobs.shape, generator=g, dtype=torch.int32))
    return outputs


def test_a_full_pool_refuses_a_copy_and_leaves_the_frames_being_decoded_alone():
    outputs = outputs_with_values()
    executor = FrameExecutor(outputs)
    held = [executor.copy(submission, [0, 2], 20) for submission in (4, 5)]
    before = [(h.records.copy(), h.payload.copy()) for h in held]
    with pytest.raises(FramePoolExhausted, match="submissions \\[4, 5\\]"):
        executor.copy(6, [1], 20)
    for host, (records, payload) in zip(held, before, strict=True):
        assert np.array_equal(host.records, records) and np.array_equal(host.payload, payload)
    assert executor.counters.frames == 2
    held[0].release()
    again = executor.copy(6, [1], 20)
    assert again.lease.index == held[0].lease.index
    assert np.array_equal(held[1].records, before[1][0])


def test_a_frame_without_requesting_lanes_copies_records_only():
    outputs = outputs_with_values()
    executor = FrameExecutor(outputs)
    executor.host_payload.fill_(-7)
    host = executor.copy(3, [], 20)
    assert np.array_equal(host.records, outputs.completion_records[1].numpy())
    assert (executor.host_payload == -7).all()
    assert executor.counters.payload_copies == executor.counters.payload_bytes == 0
    host.release()
    assert executor.pool.leased() == []
