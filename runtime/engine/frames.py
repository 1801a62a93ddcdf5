"""The coordinator's host frame pool: preallocated frames that a copy leases and decoding returns.

Every host frame is allocated once, at start-up (pinned on CUDA): records int64
[capacity, 16+T] and payload int32 storage of [capacity, T, 2+2K] words (and with a reduction
an FP32 [capacity, T] entropy row). A copy of W pairs
views the first capacity*T*(2+2W) words of its frame's payload as one contiguous
[capacity, T, 2+2W] array, so a run of requesting slots is one contiguous transfer. Views are
made once per (frame, W) and reused: after warm-up no copy creates tensor storage.

``acquire`` leases a free frame to a submission; ``release`` returns it once the frame is
decoded. A frame is never handed out while it is leased: with every frame leased, ``acquire``
raises FramePoolExhausted naming the submissions that hold them (a frame still being decoded
is never silently reused), and releasing a frame twice, or one the pool does not lease,
raises too. The bookkeeping is device-independent; only ``pin`` differs on CUDA.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.kernels.layout import FIRST_PAIR


class FramePoolExhausted(RuntimeError):
    """Every host frame is leased: a caller did not release a decoded frame."""


class FrameLeaseError(RuntimeError):
    """A release of a frame the pool does not lease to this holder (twice, or never)."""


@dataclass(frozen=True)
class FramePoolStats:
    frames: int
    """Frames in the pool (fixed at start-up)."""
    leased: int
    """Frames leased now (copied, not yet released after decoding)."""
    acquired: int
    """Leases handed out since start-up."""
    released: int
    exhausted: int
    """acquire calls refused because every frame was leased."""
    frame_bytes: int
    """Physical bytes of one frame (records + payload storage)."""

    @property
    def nbytes(self) -> int:
        return self.frames * self.frame_bytes


class FrameLease:
    """One frame leased to one submission; ``release`` returns it to its pool (once)."""

    __slots__ = ("pool", "index", "submission", "released")

    def __init__(self, pool: FramePool, index: int, submission: int) -> None:
        self.pool = pool
        self.index = index
        self.submission = submission
        self.released = False

    def release(self) -> None:
        self.pool.release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else "leased"
        return f"FrameLease(frame={self.index}, submission={self.submission}, {state})"


class FramePool:
    def __init__(self, frames: int, capacity: int, tokens: int, record_width: int, words: int,
                 *, pin: bool = False, entropy: bool = False) -> None:
        """``frames`` host frames of ``capacity`` slots, ``tokens`` positions, records of
        ``record_width`` words and payload rows of ``words`` words (the widest copy: 2+2K, or
        the chosen pair alone when the core declares no logprob outputs); ``entropy``: each
        frame also holds an FP32 [capacity, T] entropy row (return_entropy)."""
        if frames < 1:
            raise ValueError(f"frames: expected >= 1, got {frames}")
        if capacity < 1 or tokens < 1:
            raise ValueError(f"capacity, tokens: expected >= 1, got {capacity}, {tokens}")
        if words < FIRST_PAIR or words % 2:
            raise ValueError(f"words: expected an even count >= {FIRST_PAIR}, got {words}")
        self.records = torch.empty((frames, capacity, record_width), dtype=torch.int64,
                                   pin_memory=pin)
        self.payload = torch.empty((frames, capacity, tokens, words), dtype=torch.int32,
                                   pin_memory=pin)
        self.entropy = torch.empty((frames, capacity, tokens), dtype=torch.float32,
                                   pin_memory=pin) if entropy else None
        self.pinned = pin
        self._free: deque[int] = deque(range(frames))
        self._leases: dict[int, FrameLease] = {}
        self._lock = threading.Lock()
        self._views: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor, np.ndarray]] = {}
        self._acquired = self._released = self._exhausted = 0

    @property
    def frames(self) -> int:
        return self.records.shape[0]

    @property
    def words(self) -> int:
        return self.payload.shape[-1]

    def acquire(self, submission: int) -> FrameLease:
        """A free frame, leased to ``submission`` (the least recently released one)."""
        with self._lock:
            if not self._free:
                self._exhausted += 1
                held = sorted(lease.submission for lease in self._leases.values())
                raise FramePoolExhausted(
                    f"all {self.frames} host frames are leased (to submissions {held}): a "
                    f"frame returns to the pool only after its decoding releases it")
            index = self._free.popleft()
            lease = self._leases[index] = FrameLease(self, index, submission)
            self._acquired += 1
            return lease

    def release(self, lease: FrameLease) -> None:
        with self._lock:
            if lease.pool is not self or self._leases.get(lease.index) is not lease:
                raise FrameLeaseError(f"{lease!r} is not leased from this pool")
            del self._leases[lease.index]
            lease.released = True
            self._free.append(lease.index)
            self._released += 1

    def views(self, index: int, words: int) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """Frame ``index``'s records (numpy), and its payload prefix of ``words`` words per
        position as one contiguous [capacity, T, words] tensor and its numpy view (made once
        per (frame, words))."""
        views = self._views.get((index, words))
        if views is None:
            if not FIRST_PAIR <= words <= self.words or words % 2:
                raise ValueError(f"words: expected an even count in {FIRST_PAIR}..{self.words},"
                                 f" got {words}")
            capacity, tokens = self.payload.shape[1:3]
            flat = self.payload[index].view(-1)[: capacity * tokens * words]
            payload = flat.view(capacity, tokens, words)
            views = self._views[index, words] = (self.records[index].numpy(), payload,
                                                 payload.numpy())
        return views

    def leased(self) -> list[FrameLease]:
        with self._lock:
            return list(self._leases.values())

    def stats(self) -> FramePoolStats:
        with self._lock:
            frame_bytes = (self.records[0].numel() * self.records.element_size()
                           + self.payload[0].numel() * self.payload.element_size()
                           + (0 if self.entropy is None else self.entropy[0].numel() * 4))
            return FramePoolStats(self.frames, len(self._leases), self._acquired,
                                  self._released, self._exhausted, frame_bytes)
