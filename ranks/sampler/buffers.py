"""Static storage of the sampler's plan: every index, parameter and processor tensor that
``ShardedSampler.plan`` builds is a view of one of four typed pools (int64, float32, float64,
bool), sized at start-up from the sampler's rows and shard width, that the plan fills
through numpy views of their host storage. A plan therefore allocates no tensor storage, and
on CUDA its tensors sit at the same device addresses every step (one non-blocking upload of
each pool's used prefix from pinned memory ends the plan).

The variable parts (the penalties' (row, lane) cells, blocked ids, logit_bias lanes) get
CELLS_PER_ROW cells per row at start-up. A plan that needs more takes a one-off tensor for the
overflow and the pool doubles at the next plan (``grown`` counts it): storage is allocated
only by a step that needs more than every step before it.

A plan's tensors are valid until the sampler's next plan (the pools are reset there).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

CELLS_PER_ROW = 256
"""Variable-size cells (penalties, blocked ids, biased lanes) per row at start-up."""


class Pool:
    """One dtype's storage: ``take`` writes values on the host and returns the device view."""

    def __init__(self, dtype: torch.dtype, size: int, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.used = 0
        self.grown = 0
        self._want = 0
        self._overflow: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.values = torch.zeros(size, dtype=self.dtype, device=self.device)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=self.dtype, pin_memory=True) if cuda else self.values
        self.array = self.host.numpy()

    @property
    def size(self) -> int:
        return self.values.shape[0]

    def reset(self) -> None:
        if self._want > self.size:  # (the last plan overflowed: grow once, between plans)
            self._allocate(max(2 * self.size, self._want))
            self.grown += 1
        self.used = self._want = 0
        self._overflow: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reserve(self, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """(host array, device view) of n fresh elements for the caller to fill."""
        start = self.used
        self._want += n  # (every element this plan asked for, overflow included)
        if start + n > self.size:  # (a one-off block; the pool grows at the next reset)
            cuda = self.device.type == "cuda"
            host = torch.zeros(n, dtype=self.dtype, pin_memory=cuda)
            values = torch.empty(n, dtype=self.dtype, device=self.device) if cuda else host
            self._overflow.append((host, values))
            return host.numpy(), values
        self.used = start + n
        return self.array[start : start + n], self.values[start : start + n]

    def take(self, values: Sequence | np.ndarray) -> torch.Tensor:
        host, view = self.reserve(len(values))
        host[:] = values
        return view

    def upload(self) -> None:
        """The used prefix host -> device (CUDA only; on the CPU the host is the device)."""
        if self.host is not self.values and self.used:
            self.values[: self.used].copy_(self.host[: self.used], non_blocking=True)
        for host, values in self._overflow:
            if host is not values:
                values.copy_(host, non_blocking=True)


class PlanBuffers:
    """The sampler's four pools, sized for ``max_rows`` rows of ``local_valid`` lanes."""

    def __init__(self, max_rows: int, local_valid: int, device: torch.device) -> None:
        self.device = torch.device(device)
        cells = max_rows * CELLS_PER_ROW
        self.int64 = Pool(torch.int64, 24 * max_rows + 3 * cells, self.device)
        self.float32 = Pool(torch.float32, 4 * max_rows + 2 * cells, self.device)
        self.float64 = Pool(torch.float64, 4 * max_rows, self.device)
        self.bool = Pool(torch.bool, max_rows * (local_valid + 2), self.device)
        self.pools = (self.int64, self.float32, self.float64, self.bool)
        self.uploaded = torch.cuda.Event() if self.device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        return sum(p.values.numel() * p.values.element_size() for p in self.pools)

    @property
    def grown(self) -> int:
        return sum(p.grown for p in self.pools)

    def reset(self) -> None:
        """Start a plan: the last plan's upload has left the host storage."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        for pool in self.pools:
            pool.reset()

    def upload(self) -> None:
        for pool in self.pools:
            pool.upload()
        if self.uploaded is not None:
            self.uploaded.record()

    def rows(self, count: int, width: int) -> tuple[np.ndarray, torch.Tensor]:
        """(host, device) bool [count, width] rows for masks."""
        host, view = self.bool.reserve(count * width)
        return host.reshape(count, width), view.view(count, width)
