"""CompletionOutputs: the two-frame completion bundle every recipe allocates and exports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helios_logprobs.kernels.layout import EXPORT_K, FIRST_PAIR, MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.ranks.contract.abi6 import (
    ACCEPTED,
    EMITTED,
    EPOCH,
    FINISH_REASON,
    FIRST_LOGIT_ROW,
    FORCED_MASK,
    HEADER,
    KIND,
    OFFERED,
    REQUEST_ORDINAL,
    SEQUENCE_LENGTH,
    SLOT,
    SUBMISSION,
    Kind,
    record_width,
)
from helios_logprobs.ranks.contract.declarations import (
    COMPLETION_LOGPROBS,
    COMPLETION_RECORDS,
    FRAMES,
    LOGPROB_REQUESTED,
    LOGPROB_TOKEN_ID_COUNTS,
    LOGPROB_TOKEN_IDS,
    BufferDecl,
    resolve_completion_token_capacity,
)


@dataclass(frozen=True)
class CompletionFrame:
    """One frame's views: records int64 [capacity, 16+T], payload int32 [capacity, T, 2+2K]
    (258 words with the ID inputs)."""

    records: torch.Tensor
    payload: torch.Tensor


@dataclass(frozen=True)
class CompletionOutputs:
    completion_records: torch.Tensor
    completion_logprobs: torch.Tensor
    logprob_requested: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    """None in a core exported with K < 20 natural alternatives and no ID inputs."""
    logprob_token_id_counts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        records = self.completion_records
        if records.dim() != 3 or records.shape[0] != FRAMES or records.shape[1] < 1:
            raise ValueError(
                f"{COMPLETION_RECORDS}: expected [{FRAMES}, capacity, 16+T], "
                f"got {list(records.shape)}"
            )
        capacity = records.shape[1]
        tokens = records.shape[2] - HEADER
        if tokens < 1:
            raise ValueError(f"{COMPLETION_RECORDS}: expected 16+T words with T >= 1, got {tokens}")
        if (self.logprob_token_ids is None) != (self.logprob_token_id_counts is None):
            raise ValueError(
                f"{LOGPROB_TOKEN_IDS} and {LOGPROB_TOKEN_ID_COUNTS}: declared together or not "
                f"at all"
            )
        words = PAYLOAD_WORDS if self.supports_token_ids else self._natural_words()
        expected = {
            COMPLETION_RECORDS: (torch.int64, (FRAMES, capacity, record_width(tokens))),
            COMPLETION_LOGPROBS: (torch.int32, (FRAMES, capacity, tokens, words)),
            LOGPROB_REQUESTED: (torch.int32, (capacity,)),
            LOGPROB_TOKEN_IDS: (torch.int32, (capacity, MAX_TOKEN_IDS)),
            LOGPROB_TOKEN_ID_COUNTS: (torch.int32, (capacity,)),
        }
        for name, tensor in self.tensors().items():
            dtype, shape = expected[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name}: expected {dtype} {list(shape)}, got {tensor.dtype} "
                    f"{list(tensor.shape)}"
                )
            if not tensor.is_contiguous():
                raise ValueError(f"{name}: expected contiguous row-major storage")
            if tensor.device != records.device:
                raise ValueError(f"{name}: on {tensor.device}, records on {records.device}")

    def _natural_words(self) -> int:
        """The payload's last extent 2+2K of a bundle without the ID inputs (1<=K<=20)."""
        payload = self.completion_logprobs
        words = payload.shape[-1] if payload.dim() == 4 else 0
        if words % 2 or not 1 <= (words - FIRST_PAIR) // 2 <= EXPORT_K:
            raise ValueError(
                f"{COMPLETION_LOGPROBS}: expected int32 [{FRAMES}, capacity, T, 2+2K] with "
                f"1<=K<={EXPORT_K} without the ID inputs, got {list(payload.shape)}"
            )
        return words

    @classmethod
    def allocate(
        cls,
        capacity: int,
        completion_token_capacity: int | None = None,
        device: torch.device | str = "cpu",
    ) -> CompletionOutputs:
        """The complete bundle: records zero, payload and IDs -1, flags and counts zero."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        tokens = resolve_completion_token_capacity(completion_token_capacity)
        return cls(
            completion_records=torch.zeros(
                (FRAMES, capacity, record_width(tokens)), dtype=torch.int64, device=device
            ),
            completion_logprobs=torch.full(
                (FRAMES, capacity, tokens, PAYLOAD_WORDS), -1, dtype=torch.int32, device=device
            ),
            logprob_requested=torch.zeros(capacity, dtype=torch.int32, device=device),
            logprob_token_ids=torch.full(
                (capacity, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=device
            ),
            logprob_token_id_counts=torch.zeros(capacity, dtype=torch.int32, device=device),
        )

    @classmethod
    def allocate_natural(
        cls,
        capacity: int,
        k: int,
        completion_token_capacity: int | None = None,
        device: torch.device | str = "cpu",
    ) -> CompletionOutputs:
        """The bundle of a core exported with K < 20 natural alternatives and no ID inputs:
        records, completion_logprobs int32 [2, capacity, T, 2+2K] and the flag vector.

        Recipes allocate the complete bundle (``allocate``); this is the layout such a core
        declares when it is built for a smaller K (RuntimeConfig.max_logprobs < 20).
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < EXPORT_K:
            raise ValueError(f"k: expected 1..{EXPORT_K - 1}, got {k!r}")
        full = cls.allocate(capacity, completion_token_capacity, device)
        tokens = full.token_capacity
        return cls(
            completion_records=full.completion_records,
            completion_logprobs=torch.full(
                (FRAMES, capacity, tokens, FIRST_PAIR + 2 * k), -1, dtype=torch.int32,
                device=device,
            ),
            logprob_requested=full.logprob_requested,
        )

    @property
    def capacity(self) -> int:
        return self.completion_records.shape[1]

    @property
    def token_capacity(self) -> int:
        """T, the resolved completion_token_capacity."""
        return self.completion_logprobs.shape[2]

    @property
    def supports_token_ids(self) -> bool:
        """Whether the bundle holds the explicit-ID inputs (then K is 20)."""
        return self.logprob_token_ids is not None

    @property
    def k(self) -> int:
        """K, natural alternatives per position: (last extent - 2) / 2, 20 with the ID inputs."""
        if self.supports_token_ids:
            return EXPORT_K
        return (self.completion_logprobs.shape[-1] - FIRST_PAIR) // 2

    @property
    def device(self) -> torch.device:
        return self.completion_records.device

    @staticmethod
    def frame_index(submission: int) -> int:
        if submission < 0:
            raise ValueError(f"submission: expected >= 0, got {submission}")
        return submission % FRAMES

    def frame(self, index: int) -> CompletionFrame:
        """Views of frame `index` (0 or 1; a submission uses frame `submission % 2`)."""
        if index not in range(FRAMES):
            raise ValueError(f"frame index: expected 0 or 1, got {index}")
        return CompletionFrame(self.completion_records[index], self.completion_logprobs[index])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The declared buffers, in contract order (the ID inputs only when present)."""
        tensors = {
            COMPLETION_RECORDS: self.completion_records,
            COMPLETION_LOGPROBS: self.completion_logprobs,
            LOGPROB_REQUESTED: self.logprob_requested,
            LOGPROB_TOKEN_IDS: self.logprob_token_ids,
            LOGPROB_TOKEN_ID_COUNTS: self.logprob_token_id_counts,
        }
        return {name: tensor for name, tensor in tensors.items() if tensor is not None}

    def declarations(self) -> tuple[BufferDecl, ...]:
        return tuple(
            BufferDecl(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            for name, tensor in self.tensors().items()
        )

    @property
    def nbytes(self) -> int:
        """Physical bytes of the bundle's storage (each storage counted once)."""
        storages = {
            tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
            for tensor in self.tensors().values()
        }
        return sum(storages.values())


def write_record(
    records: torch.Tensor,
    slot: int,
    *,
    epoch: int,
    ordinal: int,
    kind: Kind,
    tokens: Sequence[int] = (),
    forced_mask: int = 0,
    offered: int = 0,
    accepted: int = 0,
    finish_reason: int = 0,
    sequence_length: int = 0,
    submission: int = 0,
    first_logit_row: int = 0,
) -> None:
    """Overwrite one slot's ABI6 record in a frame's records [capacity, 16+T] (host or device)."""
    if records.dim() != 2 or records.dtype != torch.int64:
        raise ValueError(f"records: expected int64 [capacity, 16+T], got {records.dtype}")
    capacity, width = records.shape
    token_capacity = width - HEADER
    if not 0 <= slot < capacity:
        raise ValueError(f"slot: expected 0..{capacity - 1}, got {slot}")
    if len(tokens) > token_capacity:
        raise ValueError(f"tokens: at most T={token_capacity}, got {len(tokens)}")
    if forced_mask >> len(tokens):
        raise ValueError(f"forced_mask {forced_mask:#x} marks positions past {len(tokens)} tokens")
    row = [0] * width
    for index, value in (
        (SLOT, slot),
        (EPOCH, epoch),
        (REQUEST_ORDINAL, ordinal),
        (KIND, int(kind)),
        (EMITTED, len(tokens)),
        (FORCED_MASK, forced_mask),
        (OFFERED, offered),
        (ACCEPTED, accepted),
        (FINISH_REASON, int(finish_reason)),
        (SEQUENCE_LENGTH, sequence_length),
        (SUBMISSION, submission),
        (FIRST_LOGIT_ROW, first_logit_row),
    ):
        row[index] = value
    row[HEADER : HEADER + len(tokens)] = [int(t) for t in tokens]
    records[slot].copy_(torch.tensor(row, dtype=torch.int64))
