"""The reduction gate and payload write on host tensors in C (gate.c), for StepReduction.

On CPU the gate's dozen tensor (or numpy) operations cost ~0.1-0.3 ms per step, more than
the compiled reduction of a row; the C loop costs a few microseconds. The record indices come
from ranks/step/abi6.h, a copy of ranks/contract/abi6.py that a test compares with it. Where
the package was built without the native extension (kernels/native.py), or with
``HELIOS_NATIVE=0``, ``native_gate()`` is None and StepReduction keeps its tensor-op form
(CUDA's), which tests compare this one with.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from helios_logprobs.kernels.native import library
from helios_logprobs.ranks.contract.completion import CompletionOutputs

_P, _I = ctypes.c_void_p, ctypes.c_int64


def native_gate() -> ctypes.CDLL | None:
    return library()


class StepBlock(ctypes.Structure):
    """gate.c's StepBlock: step_reduce's arguments that stay the same from step to step."""

    _fields_ = [("records", _P * 2), ("payload", _P * 2), ("capacity", _I), ("width", _I),
                ("tokens", _I), ("words", _I), ("requested_by_slot", _P), ("requested", _P),
                ("chosen", _P), ("ids_src", _P), ("counts_src", _P), ("ids", _P),
                ("counts", _P), ("max_ids", _I), ("vocab", _I), ("reduce", _P),
                ("reduce_block", _P), ("out", _P), ("out_width", _I), ("row_slots", _P),
                ("row_epochs", _P), ("row_positions", _P)]


def _pointer(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    if tensor.dtype != dtype or not tensor.is_contiguous() or not tensor.is_cpu:
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got "
                         f"{tensor.dtype} strides {list(tensor.stride())} on {tensor.device}")
    return tensor.data_ptr()


class NativeStepGate:
    """StepReduction's gate and write over its fixed buffers: every buffer is checked and its
    address taken once here; a call checks and passes only the step's row tensors."""

    _GATE_ERROR = "gate: a row's slot is outside capacity {}"
    _WRITE_ERROR = "write: a gated row's (slot, position) is outside [{}, {}]"

    def __init__(self, lib: ctypes.CDLL, outputs: CompletionOutputs, requested: torch.Tensor,
                 chosen: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                 out: torch.Tensor, vocab_size: int) -> None:
        self.lib = lib
        self.vocab_size = vocab_size
        records, payload = outputs.completion_records, outputs.completion_logprobs
        self.records = [_pointer("completion_records", records[f], torch.int64)
                        for f in range(records.shape[0])]
        self.capacity, self.width = records.shape[1], records.shape[2]
        self.payload = [_pointer("completion_logprobs", payload[f], torch.int32)
                        for f in range(payload.shape[0])]
        self.tokens, self.words = payload.shape[2], payload.shape[3]
        self.requested_by_slot = _pointer("logprob_requested", outputs.logprob_requested,
                                          torch.int32)
        self.rows = requested.shape[0]
        if chosen.shape[0] != self.rows or out.shape[0] != self.rows \
                or out.shape[1] < self.words:
            raise ValueError(f"gate buffers: requested {list(requested.shape)}, chosen "
                             f"{list(chosen.shape)}, out {list(out.shape)} for "
                             f"{self.words} payload words")
        self.requested = _pointer("requested", requested, torch.int32)
        self.chosen = _pointer("chosen", chosen, torch.int64)
        self.out, self.out_width = _pointer("out", out, torch.int32), out.shape[1]
        self.selected = (None, None, None, None)
        self.max_ids = 0
        self._bound = None
        """The RepeatedCall whose StepBlock is prepared (see _bind)."""
        self._row_vectors = tuple(np.empty(self.rows, np.int64) for _ in range(3))
        """step's row slots, epochs and positions, at addresses the StepBlock holds."""

        if outputs.supports_token_ids:
            self.max_ids = ids.shape[1]
            self.selected = (
                _pointer("logprob_token_ids", outputs.logprob_token_ids, torch.int32),
                _pointer("logprob_token_id_counts", outputs.logprob_token_id_counts,
                         torch.int32),
                _pointer("ids", ids, torch.int32), _pointer("counts", counts, torch.int32))

    def _rows(self, *tensors: torch.Tensor) -> int:
        rows = tensors[0].shape[0]
        if rows > self.rows or any(t.shape[0] != rows for t in tensors):
            raise ValueError(f"gate: row tensors of {[t.shape[0] for t in tensors]} rows for "
                             f"{self.rows} buffer rows")
        return rows

    def _gate_args(self, frame: int, row_slots: torch.Tensor, row_epochs: torch.Tensor,
                   row_positions: torch.Tensor) -> tuple:
        rows = self._rows(row_slots, row_epochs, row_positions)
        return (self.records[frame], self.capacity, self.width,
                _pointer("row_slots", row_slots, torch.int64),
                _pointer("row_epochs", row_epochs, torch.int64),
                _pointer("row_positions", row_positions, torch.int64), rows,
                self.requested_by_slot, self.requested, self.chosen, *self.selected,
                self.max_ids, self.vocab_size)

    def gate(self, frame: int, row_slots: torch.Tensor, row_epochs: torch.Tensor,
             row_positions: torch.Tensor) -> None:
        if self.lib.gate_rows(*self._gate_args(frame, row_slots, row_epochs, row_positions)):
            raise IndexError(self._GATE_ERROR.format(self.capacity))

    def step(self, frame: int, row_slots: list[int], row_epochs: list[int],
             row_positions: list[int], write_rows: int, call, threads: int) -> bool:
        """gate, the prepared one-rank reduction ``call`` (kernels' RepeatedCall: its C entry
        and argument block) and write of the first ``write_rows`` rows, in one C call. The
        row lists (one entry per buffer row) are copied into this object's row vectors
        (``row_tensors`` views two of them). False when the reduction left rows for Python:
        the gate is done, nothing is written."""
        if self._bound is not call:
            self._bind(call)
        if not 0 <= write_rows <= self.rows:
            raise ValueError(f"write_rows {write_rows} outside [0, {self.rows}]")
        if not 0 <= frame < len(self.records):
            raise ValueError(f"frame {frame} outside [0, {len(self.records) - 1}]")
        slots, epochs, positions = self._row_vectors
        slots[:] = row_slots  # (numpy: a list of another length is a ValueError)
        epochs[:] = row_epochs
        positions[:] = row_positions
        status = self.lib.step_reduce(self._block_address, frame, self.rows, write_rows,
                                      threads)
        if status == -1:
            raise IndexError(self._GATE_ERROR.format(self.capacity))
        if status == -2:
            raise IndexError(self._WRITE_ERROR.format(self.capacity, self.tokens))
        return status == 0

    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last step's row slots and positions (views of the row vectors), for the write
        after the Python path."""
        return torch.from_numpy(self._row_vectors[0]), torch.from_numpy(self._row_vectors[2])

    def _bind(self, call) -> None:
        """step_reduce's fixed arguments for ``call``, in one block (built on its first step:
        one pointer instead of two dozen converted arguments per call)."""
        ids_src, counts_src, ids, counts = self.selected
        self._block = StepBlock(
            (_P * 2)(*self.records), (_P * 2)(*self.payload), self.capacity, self.width,
            self.tokens, self.words, self.requested_by_slot, self.requested, self.chosen,
            ids_src, counts_src, ids, counts, self.max_ids, self.vocab_size, call.function,
            call.block, self.out, self.out_width, *(v.ctypes.data for v in self._row_vectors))
        self._block_address = ctypes.addressof(self._block)
        self._bound = call

    def write(self, frame: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        rows = self._rows(slots, positions)
        status = self.lib.write_payload(
            self.payload[frame], self.capacity, self.tokens, self.words, self.out,
            self.out_width, self.requested, _pointer("slots", slots, torch.int64),
            _pointer("positions", positions, torch.int64), rows)
        if status != 0:
            raise IndexError(self._WRITE_ERROR.format(self.capacity, self.tokens))
