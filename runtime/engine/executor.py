"""Frame copies into preallocated host memory: records always, payload only for requesters.

A frame's packed payload is copied only for the physical slots that requested logprobs in
that submission, and only each position's chosen pair plus the first W pairs, W = the larger
of K and the frame's largest selected-ID count. Frames without a requesting lane copy no
payload. On CUDA the host frames are pinned and the copy runs on its own stream after the
producing event; the decoder reads them only after the transfer event.

On CUDA each frame has its own contiguous pinned payload storage, laid out [capacity, T, 2+2W]
for the copy's W (so a requesting run is one contiguous device-to-host copy), and the
requesting runs are first packed on the copy stream into a preallocated device staging
buffer of the same layout (a strided device source would make the transfer allocate a
contiguous temporary). The producing and transfer events are preallocated per frame; nothing
is allocated per copy. On CPU the frames are numpy copies, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from helios_logprobs.kernels.layout import FIRST_PAIR
from helios_logprobs.ranks.contract.completion import CompletionOutputs


@dataclass(frozen=True)
class HostFrame:
    submission: int
    """The plan whose records and payload this frame holds (the decoder checks the records)."""
    frame: int
    records: np.ndarray
    """int64 [capacity, 16+T], a host copy (a view of the executor's host frame)."""
    payload: np.ndarray
    """int32 [capacity, T, 2+2W]; only rows of requesting slots are meaningful."""
    requesting: tuple[int, ...]
    """Physical slots whose payload was copied (the request mask)."""
    width: int
    """W: pairs copied per position."""


@dataclass
class ExecutorCounters:
    frames: int = 0
    payload_copies: int = 0
    payload_bytes: int = 0
    record_bytes: int = 0


class FrameExecutor:
    def __init__(self, outputs: CompletionOutputs, logprobs: bool = True) -> None:
        """``logprobs`` False: the core declares no logprob outputs, so no host payload storage
        exists and no payload transfer can be asked for."""
        self.outputs = outputs
        records = outputs.completion_records
        payload = outputs.completion_logprobs
        pin = records.is_cuda
        self.host_records = torch.empty(records.shape, dtype=records.dtype, pin_memory=pin)
        shape = payload.shape if logprobs else (*payload.shape[:-1], FIRST_PAIR)
        self.host_payload = torch.empty(shape, dtype=payload.dtype, pin_memory=pin)
        self.stream = torch.cuda.Stream() if pin else None
        self.staging = None
        """CUDA: the device staging frame (flat; viewed [capacity, T, 2+2W] per copy)."""
        if pin:
            self.staging = torch.empty(self.host_payload[0].numel(), dtype=payload.dtype,
                                       device=payload.device)
            self.produced = [torch.cuda.Event() for _ in range(shape[0])]
            self.transferred = [torch.cuda.Event() for _ in range(shape[0])]
        self.counters = ExecutorCounters()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, np.ndarray,
                                                 np.ndarray]] = {}
        self._host_source = None if pin else (records.numpy(), payload.numpy())
        """Host frames: the copies go through numpy views (a torch index costs 1-3 us)."""

    def _frame_views(self, frame: int, words: int):
        """The host records and payload prefix of ``frame`` as tensors and as numpy arrays
        (views made once per width)."""
        views = self._views.get((frame, words))
        if views is None:
            records, payload = self.host_records[frame], self.host_payload[frame, :, :, :words]
            if self.staging is not None:  # contiguous [capacity, T, words] pinned storage
                capacity, tokens = payload.shape[:2]
                payload = self.host_payload[frame].view(-1)[: capacity * tokens * words].view(
                    capacity, tokens, words)
            views = self._views[frame, words] = (records, payload, records.numpy(),
                                                 payload.numpy())
        return views

    def copy(self, submission: int, requesting: list[int], width: int) -> HostFrame:
        """Copy submission's frame (``submission % 2``): its records, and for ``requesting``
        slots the chosen pair plus ``width`` pairs per position (the upload protocol's W)."""
        frame = CompletionOutputs.frame_index(submission)
        words = FIRST_PAIR + 2 * width
        if words > self.host_payload.shape[-1]:
            raise ValueError(f"width {width}: the host frames hold {self.host_payload.shape[-1]} "
                             f"words per position")
        records, payload, host_records, host_payload = self._frame_views(frame, words)
        self.counters.frames += 1
        if self.stream is not None:
            produced, done = self.produced[frame], self.transferred[frame]
            produced.record()
            self.stream.wait_event(produced)
            with torch.cuda.stream(self.stream):
                self._copy(frame, requesting, records, payload, words)
            done.record(self.stream)
            done.synchronize()  # decoding (the caller, next) waits on the transfer only
        else:
            self._copy(frame, requesting, records, payload, words)
        return HostFrame(submission, frame, host_records, host_payload, tuple(requesting),
                         width)

    def _copy(self, frame, requesting, records, payload, words) -> None:
        self.counters.record_bytes += records.numel() * records.element_size()
        runs = slot_runs(requesting)
        if self._host_source is not None:
            source_records, source_payload = self._host_source
            records.numpy()[:] = source_records[frame]
            if requesting:
                rows, source = payload.numpy(), source_payload[frame]
                for start, stop in runs:  # (slices: an advanced index costs as much as 16)
                    rows[start:stop] = source[start:stop, :, :words]
        else:
            records.copy_(self.outputs.completion_records[frame], non_blocking=True)
            source = self.outputs.completion_logprobs[frame]
            staging = self.staging[: payload.numel()].view(payload.shape)
            for start, stop in runs:
                staging[start:stop].copy_(source[start:stop, :, :words])
                payload[start:stop].copy_(staging[start:stop], non_blocking=True)
        if requesting:
            self.counters.payload_bytes += words * 4 * payload.shape[1] * len(requesting)
            self.counters.payload_copies += 1


def slot_runs(slots: list[int]) -> list[tuple[int, int]]:
    """The slots as [start, stop) runs of consecutive ones, in their order: one copy per run."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs
