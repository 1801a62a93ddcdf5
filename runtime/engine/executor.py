"""Frame copies into preallocated host memory: records always, payload only for requesters.

A frame's packed payload is copied only for the physical slots that requested logprobs in
that submission, and only each position's chosen pair plus the first W pairs, W = the larger
of K and the frame's largest selected-ID count. Frames without a requesting lane copy no
payload. On CUDA the host frames are pinned and the copy runs on its own stream after the
producing event; the decoder reads them only after the transfer event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.layout import FIRST_PAIR
from ranks.contract.completion import CompletionOutputs


@dataclass(frozen=True)
class HostFrame:
    submission: int
    """The plan whose records and payload this frame holds (the decoder checks the records)."""
    frame: int
    records: torch.Tensor
    """int64 [capacity, 16+T], a host copy."""
    payload: torch.Tensor
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
        self.counters = ExecutorCounters()

    def copy(self, submission: int, requesting: list[int], width: int) -> HostFrame:
        """Copy submission's frame (``submission % 2``): its records, and for ``requesting``
        slots the chosen pair plus ``width`` pairs per position (the upload protocol's W)."""
        frame = CompletionOutputs.frame_index(submission)
        words = FIRST_PAIR + 2 * width
        if words > self.host_payload.shape[-1]:
            raise ValueError(f"width {width}: the host frames hold {self.host_payload.shape[-1]} "
                             f"words per position")
        records = self.host_records[frame]
        payload = self.host_payload[frame, :, :, :words]
        self.counters.frames += 1
        if self.stream is not None:
            produced = torch.cuda.Event()
            produced.record()
            self.stream.wait_event(produced)
            with torch.cuda.stream(self.stream):
                self._copy(frame, requesting, records, payload, words)
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()
        else:
            self._copy(frame, requesting, records, payload, words)
        return HostFrame(submission, frame, records, payload, tuple(requesting), width)

    def _copy(self, frame, requesting, records, payload, words) -> None:
        records.copy_(self.outputs.completion_records[frame], non_blocking=True)
        self.counters.record_bytes += records.numel() * records.element_size()
        if not requesting:
            return
        source = self.outputs.completion_logprobs[frame]
        per_slot = payload[0].numel() * 4
        if self.stream is None:  # host memory: one gather of the requesting rows
            at = list(requesting)
            payload.numpy()[at] = source.numpy()[at, :, :words]
        else:
            for slot in requesting:
                payload[slot].copy_(source[slot, :, :words], non_blocking=True)
        self.counters.payload_bytes += per_slot * len(requesting)
        self.counters.payload_copies += 1
