"""The host frame pool's bookkeeping (runtime/engine/frames.py), device-independent: leases,
exhaustion, releases, and the per-width views that copies reuse."""

from __future__ import annotations

import numpy as np
import pytest

from helios_logprobs.runtime.engine.frames import (
    FrameLeaseError,
    FramePool,
    FramePoolExhausted,
)

CAPACITY, TOKENS, RECORD_WIDTH, WORDS = 4, 3, 19, 12


def pool(frames: int = 2) -> FramePool:
    return FramePool(frames, CAPACITY, TOKENS, RECORD_WIDTH, WORDS)


def test_leases_are_distinct_frames_and_exhaustion_names_the_holders() -> None:
    frames = pool(3)
    leases = [frames.acquire(submission) for submission in (7, 8, 9)]
    assert sorted(lease.index for lease in leases) == [0, 1, 2]
    with pytest.raises(FramePoolExhausted, match=r"all 3 host frames .*\[7, 8, 9\]"):
        frames.acquire(10)
    stats = frames.stats()
    assert (stats.leased, stats.acquired, stats.released, stats.exhausted) == (3, 3, 0, 1)
    leases[1].release()
    again = frames.acquire(10)
    assert again.index == leases[1].index and again.submission == 10
    assert frames.stats().leased == 3


def test_a_frame_is_released_once_and_only_to_its_own_pool() -> None:
    frames, other = pool(), pool()
    lease = frames.acquire(1)
    lease.release()
    with pytest.raises(FrameLeaseError, match="not leased"):
        lease.release()
    held = other.acquire(1)
    with pytest.raises(FrameLeaseError):
        frames.release(held)
    # A stale lease of a frame leased again does not free the new holder's frame.
    first = frames.acquire(2)
    first.release()
    frames.acquire(3), frames.acquire(4)  # (both frames, one of them first's)
    with pytest.raises(FrameLeaseError):
        first.release()
    assert {lease.submission for lease in frames.leased()} == {3, 4}
    with pytest.raises(FramePoolExhausted):
        frames.acquire(5)


def test_a_leased_frame_is_never_handed_out_while_it_is_decoded() -> None:
    """Frames are written through their views while held; a cycle of acquire, write, release
    over many submissions never gives a frame to a second holder before it is released."""
    frames = pool(2)
    rng = np.random.default_rng(0)
    held: dict[int, tuple[object, np.ndarray]] = {}
    for submission in range(200):
        if len(held) == 2 or (held and rng.random() < 0.4):
            victim = sorted(held)[int(rng.integers(len(held)))]
            lease, written = held.pop(victim)
            records, _, payload = frames.views(lease.index, WORDS)
            assert (records == written[0]).all() and (payload == written[1]).all()
            lease.release()
        lease = frames.acquire(submission)
        assert lease.index not in {other.index for other, _ in held.values()}
        records, _, payload = frames.views(lease.index, WORDS)
        records[:] = submission
        payload[:] = -submission
        held[submission] = (lease, (records.copy(), payload.copy()))


def test_views_are_contiguous_prefixes_made_once_per_width() -> None:
    frames = pool(2)
    base = frames.payload.untyped_storage().data_ptr()
    frame_bytes = CAPACITY * TOKENS * WORDS * 4
    for index in (0, 1):
        for words in (2, 6, WORDS):
            records, tensor, array = frames.views(index, words)
            assert array.shape == (CAPACITY, TOKENS, words) and array.flags["C_CONTIGUOUS"]
            assert tensor.untyped_storage().data_ptr() == base
            assert array.ctypes.data == base + index * frame_bytes
            assert frames.views(index, words)[2] is array  # (no new view, no new storage)
            assert records.shape == (CAPACITY, RECORD_WIDTH)
    for bad in (0, 3, WORDS + 2):
        with pytest.raises(ValueError, match="words"):
            frames.views(0, bad)
    assert frames.stats().nbytes == frames.records.nbytes + frames.payload.nbytes


@pytest.mark.parametrize("arguments", [(0, 4, 3, 19, 12), (2, 0, 3, 19, 12),
                                       (2, 4, 3, 19, 5), (2, 4, 3, 19, 0)])
def test_bad_geometry_is_refused(arguments) -> None:
    with pytest.raises(ValueError):
        FramePool(*arguments)
