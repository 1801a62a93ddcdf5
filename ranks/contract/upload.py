"""The per-submission upload of logprob flags, selected-ID counts and ID prefixes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from helios_logprobs.kernels.layout import EXPORT_K
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.contract.requests import check_logprob_request


@dataclass(frozen=True)
class LaneRequest:
    """What one lane of a submission asks for: N natural alternatives or selected IDs."""

    natural_alternatives: int | None = None
    """N: the natural top-N the lane exports (the core's K for a serving request; None:
    selected ids only)."""
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.token_ids is not None and not isinstance(self.token_ids, tuple):
            if isinstance(self.token_ids, (str, bytes)) or not isinstance(self.token_ids, Sequence):
                raise TypeError(f"token_ids: expected a sequence of ints, got {self.token_ids!r}")
            object.__setattr__(self, "token_ids", tuple(self.token_ids))

    @property
    def requesting(self) -> bool:
        return self.natural_alternatives is not None or self.token_ids is not None


@dataclass(frozen=True)
class UploadResult:
    requesting_slots: tuple[int, ...]
    """Physical slots whose flag is set in this submission (the frame's request mask)."""
    copy_width: int
    """W = max(K, largest selected count); 0 when no lane requests (no payload copy)."""

    def __post_init__(self) -> None:
        if self.copy_width < 0 or (self.copy_width == 0) != (not self.requesting_slots):
            raise ValueError(
                f"copy_width {self.copy_width} inconsistent with slots {self.requesting_slots}"
            )

    @property
    def payload_words(self) -> int:
        """Words per position the executor copies: the chosen pair and W pairs."""
        return 2 + 2 * self.copy_width if self.requesting_slots else 0


class LogprobUploader:
    """Writes one submission's flag vector, count vector and selected-ID prefixes.

    Built only for a core with logprob outputs; a bundle without the ID inputs (K < 20)
    receives the flag vector alone.
    """

    def __init__(
        self, outputs: CompletionOutputs, vocab_size: int, k: int, supports_token_ids: bool
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
        if not 0 <= k <= EXPORT_K:
            raise ValueError(f"k: expected 0..{EXPORT_K}, got {k}")
        if supports_token_ids and k != EXPORT_K:
            raise ValueError(f"supports_token_ids requires k={EXPORT_K}, got k={k}")
        if supports_token_ids and not outputs.supports_token_ids:
            raise ValueError("supports_token_ids: the bundle declares no ID inputs")
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.k = k
        self.supports_token_ids = supports_token_ids
        self.host = not outputs.logprob_requested.is_cuda
        """Host vectors are written through numpy (a torch.tensor + copy_ costs ~5 us)."""
        self._checked: dict[int, LaneRequest] = {}
        """Slot -> the lane object last validated there (a request's lane is one frozen
        object for its whole life: validated on its first submission, not on every step)."""

    def check(self, lane: LaneRequest) -> None:
        check_logprob_request(
            lane.natural_alternatives, lane.token_ids, self.vocab_size, self.k,
            self.supports_token_ids,
        )

    def upload(self, submission_lanes: Mapping[int, LaneRequest]) -> UploadResult:
        """Validate every lane, then write the full vectors; nothing is written on refusal."""
        capacity = self.outputs.capacity
        checked = self._checked
        flags = [0] * capacity
        counts = [0] * capacity
        requesting: list[int] = []
        selecting: list[tuple[int, tuple[int, ...]]] = []
        for slot, lane in submission_lanes.items():
            if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < capacity:
                raise ValueError(f"slot: expected 0..{capacity - 1}, got {slot!r}")
            if checked.get(slot) is not lane:
                self.check(lane)
            if lane.requesting:
                flags[slot] = 1
                requesting.append(slot)
            if lane.token_ids:
                counts[slot] = len(lane.token_ids)
                selecting.append((slot, lane.token_ids))
        checked.update(submission_lanes)
        outputs = self.outputs
        if self.host:
            outputs.logprob_requested.numpy()[:] = flags
            if outputs.logprob_token_id_counts is not None:
                outputs.logprob_token_id_counts.numpy()[:] = counts
        else:
            outputs.logprob_requested.copy_(torch.tensor(flags, dtype=torch.int32))
            if outputs.logprob_token_id_counts is not None:
                outputs.logprob_token_id_counts.copy_(torch.tensor(counts, dtype=torch.int32))
        for slot, token_ids in selecting:
            if self.host:  # (numpy: no tensor storage per step)
                outputs.logprob_token_ids.numpy()[slot, : len(token_ids)] = token_ids
                continue
            prefix = torch.tensor(token_ids, dtype=torch.int32)
            outputs.logprob_token_ids[slot, : len(prefix)].copy_(prefix)
        requesting.sort()
        width = max([self.k, *(len(ids) for _, ids in selecting)]) if requesting else 0
        return UploadResult(requesting_slots=tuple(requesting), copy_width=width)
