"""Frame copies into the host frame pool: records always, payload only for requesters.

A frame's packed payload is copied only for the physical slots that requested logprobs in
that submission, and only each position's chosen pair plus the first W pairs, W = the larger
of K and the frame's largest selected-ID count. Frames without a requesting lane copy no
payload. Each copy leases a frame of the FramePool (runtime/engine/frames.py, allocated at
start-up, pinned on CUDA) and the frame goes back to the pool once decoded
(``HostFrame.release``, called by the frame reader); the pool refuses a lease rather than
reuse a frame still being decoded.

On CUDA the executor records the producing event on the step's stream; the copy stream waits
on it, packs the requesting runs into a preallocated device staging frame laid out
[capacity, T, 2+2W] (a strided device source would make the transfer allocate a contiguous
temporary), copies each run with one contiguous non-blocking transfer into the leased
frame's pinned [capacity, T, 2+2W] storage, and records the frame's transfer event. Nothing
waits on the host there: the HostFrame's first read (the decoder's) waits on the transfer
event. The events are preallocated (one producing event per device frame, one transfer event
per pool frame); nothing is allocated per copy. On CPU the frames are numpy copies.

A submission whose plan asks for entropy (StepPlan.entropy) also copies the reduction's FP32
entropy frame [capacity, T] into the leased frame's own host row (on CUDA on the same copy
stream, before the transfer event); other copies leave that row alone and the HostFrame's
``entropy`` is None.

The engine decodes a frame before it runs the next step, so the device frame (rewritten two
submissions later) is never overwritten while its transfer is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.kernels.layout import FIRST_PAIR
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.contract.declarations import FRAMES
from helios_logprobs.runtime.engine.frames import FrameLease, FramePool


class HostFrame:
    """One copied frame. ``records`` and ``payload`` wait on the transfer event at the first
    read (CUDA), so decoding starts only once the copy landed; ``release`` returns the frame
    to its pool after decoding (a no-op for a frame built outside a pool)."""

    __slots__ = ("submission", "frame", "requesting", "width", "lease", "_records",
                 "_payload", "_transfer", "_entropy")

    def __init__(self, submission: int, frame: int, records: np.ndarray, payload: np.ndarray,
                 requesting: tuple[int, ...], width: int, *, lease: FrameLease | None = None,
                 transfer: torch.cuda.Event | None = None,
                 entropy: np.ndarray | None = None) -> None:
        self.submission = submission
        """The plan whose records and payload this frame holds (the decoder checks them)."""
        self.frame = frame
        """The device frame copied (``submission % 2``)."""
        self.requesting = requesting
        """Physical slots whose payload was copied (the request mask)."""
        self.width = width
        """W: pairs copied per position."""
        self.lease = lease
        self._records = records
        self._payload = payload
        self._transfer = transfer
        self._entropy = entropy

    def _landed(self) -> None:
        if self._transfer is not None:
            self._transfer.synchronize()
            self._transfer = None

    @property
    def records(self) -> np.ndarray:
        """int64 [capacity, 16+T] (a view of the pool frame)."""
        self._landed()
        return self._records

    @property
    def payload(self) -> np.ndarray:
        """int32 [capacity, T, 2+2W], contiguous; only rows of requesting slots are
        meaningful."""
        self._landed()
        return self._payload

    @property
    def entropy(self) -> np.ndarray | None:
        """FP32 [capacity, T]: each reduced position's entropy (meaningful for requesting
        slots' emitted, unforced positions of entropy requests); None when not copied."""
        if self._entropy is not None:
            self._landed()
        return self._entropy

    def release(self) -> None:
        """Return the frame to its pool (after decoding: the arrays are then reused)."""
        if self.lease is not None:
            self._landed()
            self.lease.release()


@dataclass
class ExecutorCounters:
    frames: int = 0
    payload_copies: int = 0
    payload_bytes: int = 0
    record_bytes: int = 0


class FrameExecutor:
    def __init__(self, outputs: CompletionOutputs, logprobs: bool = True,
                 frames: int = FRAMES, entropy: torch.Tensor | None = None) -> None:
        """``logprobs`` False: the core declares no logprob outputs, so no host payload storage
        exists and no payload transfer can be asked for. ``frames``: the pool's size (one
        per device frame: a copy can be in flight while the other frame is decoded).
        ``entropy``: the reduction's FP32 entropy frames [2, capacity, T] (None: no
        reduction, so no copy can ask for entropy)."""
        self.outputs = outputs
        records = outputs.completion_records
        payload = outputs.completion_logprobs
        pin = records.is_cuda
        words = payload.shape[-1] if logprobs else FIRST_PAIR
        capacity, tokens = payload.shape[1:3]
        self.pool = FramePool(frames, capacity, tokens, records.shape[-1], words, pin=pin,
                              entropy=entropy is not None)
        self.stream = torch.cuda.Stream(records.device) if pin else None
        self.staging = None
        """CUDA: the device staging frame (flat; viewed [capacity, T, 2+2W] per copy)."""
        if pin:
            self.staging = torch.empty(capacity * tokens * words, dtype=payload.dtype,
                                       device=payload.device)
            self.produced = [torch.cuda.Event() for _ in range(records.shape[0])]
            self.transferred = [torch.cuda.Event() for _ in range(frames)]
        self.entropy_source = entropy
        self.counters = ExecutorCounters()
        self._staging_views: dict[int, torch.Tensor] = {}
        self._host_source = None if pin else (records.numpy(), payload.numpy())
        """Host frames: the copies go through numpy views (a torch index costs 1-3 us)."""

    @property
    def host_records(self) -> torch.Tensor:
        """The pool's records, int64 [frames, capacity, 16+T]."""
        return self.pool.records

    @property
    def host_entropy(self) -> torch.Tensor | None:
        """The pool's entropy rows, FP32 [frames, capacity, T] (None without a reduction)."""
        return self.pool.entropy

    @property
    def host_payload(self) -> torch.Tensor:
        """The pool's payload storage, int32 [frames, capacity, T, words]."""
        return self.pool.payload

    def copy(self, submission: int, requesting: list[int], width: int,
             entropy: bool = False) -> HostFrame:
        """Copy submission's frame (``submission % 2``) into a leased pool frame: its records,
        and for ``requesting`` slots the chosen pair plus ``width`` pairs per position (the
        upload protocol's W); with ``entropy`` also the frame's entropy. The caller releases
        the HostFrame after decoding it."""
        frame = CompletionOutputs.frame_index(submission)
        words = FIRST_PAIR + 2 * width
        if words > self.pool.words:
            raise ValueError(f"width {width}: the host frames hold {self.pool.words} "
                             f"words per position")
        if entropy and self.entropy_source is None:
            raise ValueError("entropy: this core has no reduction to compute it")
        lease = self.pool.acquire(submission)
        records, payload, host_payload = self.pool.views(lease.index, words)
        host_entropy = self.host_entropy[lease.index] if entropy else None
        self.counters.frames += 1
        transfer = None
        if self.stream is not None:
            produced, transfer = self.produced[frame], self.transferred[lease.index]
            produced.record()  # the producing step's work, on its stream
            self.stream.wait_event(produced)
            with torch.cuda.stream(self.stream):
                self._copy_device(frame, requesting, lease.index, payload, words)
                if host_entropy is not None:
                    host_entropy.copy_(self.entropy_source[frame], non_blocking=True)
            transfer.record(self.stream)
        else:
            self._copy_host(frame, requesting, records, host_payload, words)
            if host_entropy is not None:
                host_entropy.copy_(self.entropy_source[frame])
        self._count(requesting, words, payload.shape[1])
        return HostFrame(submission, frame, records, host_payload, tuple(requesting), width,
                         lease=lease, transfer=transfer,
                         entropy=None if host_entropy is None else host_entropy.numpy())

    def _count(self, requesting, words: int, tokens: int) -> None:
        self.counters.record_bytes += self.pool.records[0].numel() * 8
        if requesting:
            self.counters.payload_bytes += words * 4 * tokens * len(requesting)
            self.counters.payload_copies += 1

    def _copy_host(self, frame, requesting, records, payload, words) -> None:
        source_records, source_payload = self._host_source
        records[:] = source_records[frame]
        if requesting:
            source = source_payload[frame]
            for start, stop in slot_runs(requesting):  # (an advanced index costs as much)
                payload[start:stop] = source[start:stop, :, :words]

    def _copy_device(self, frame, requesting, index, payload, words) -> None:
        self.pool.records[index].copy_(self.outputs.completion_records[frame],
                                       non_blocking=True)
        if not requesting:
            return
        staging = self._staging_views.get(words)
        if staging is None:
            staging = self._staging_views[words] = self.staging[: payload.numel()].view(
                payload.shape)
        source = self.outputs.completion_logprobs[frame]
        for start, stop in slot_runs(requesting):
            staging[start:stop].copy_(source[start:stop, :, :words])
            payload[start:stop].copy_(staging[start:stop], non_blocking=True)


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """The slots as [start, stop) runs of consecutive ones, in their order: one copy per run."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs
