"""Triton logprob reduction over vocabulary shards: six prepared launches per rank.

Each rank holds ``logits`` [rows, width] for its shard: global ids vocab_start + lane for
lane < local_valid; later lanes are padding and never read. The backend-agnostic driver
(kernels/sharded.py) calls, per step:

    shard_stats        launches 1-2   -> e1_out [rows, 2]      all-gather -> e1_all
    shard_candidates   launches 3-5   -> e2_out [rows, 129]    all-gather -> e2_all
    final_merge        launch 6       -> out [rows, 258] (identical on every rank)

1. ``tile_stats_kernel`` (triton_common), grid (rows, tiles): tile FP32 max and exp mass.
2. ``_shard_stats_kernel``, grid (rows,): the shard's (max, mass) as FP32 bits -> e1_out.
3. ``_global_lse_kernel``, grid (rows,): every shard's (max, mass) combined in rank order ->
   lse. All ranks run the same kernel on the same gathered words, so lse is bit-identical.
4. ``tile_keys_kernel`` (triton_common), grid (rows, tiles): per tile the best 32 sort keys
   of float32(x) - lse with GLOBAL ids.
5. ``_shard_merge_kernel``, grid (rows,): the shard's best 32 keys, or the raw logits of the
   selected IDs it owns, and the chosen token's raw logit if it owns it -> e2_out.
6. ``_sharded_final_kernel``, grid (rows,): the owners' words and every shard's keys -> the
   packed payload, the same on every rank.

A zero ``requested`` flag makes every launch return before reading the vocabulary, sorting
or writing: that row of e1_out, e2_out, lse_out and out stays untouched. Kernels 2, 3, 5 and 6
live in kernels/triton/sharded_kernels.py; the shared geometry, workspaces and argument
checks in kernels/triton/prepared.py; the three launch groups are triton_ops
(kernels/triton/ops.py), which the prepared object calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helios_logprobs.kernels.layout import (
    EXCHANGE1_WORDS,
    EXCHANGE2_WORDS,
    PAYLOAD_WORDS,
    TILE_CANDIDATES,
)
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.triton.ops import (
    FINAL_MERGE_BLOCK as FINAL_MERGE_BLOCK,
)
from helios_logprobs.kernels.triton.ops import (
    triton_final_merge,
    triton_shard_candidates,
    triton_shard_stats,
)
from helios_logprobs.kernels.triton.prepared import (
    FLAG_DTYPES,
    PreparedWorkspaces,
    check_k,
    check_matrix,
    check_request,
    check_vector,
)
from helios_logprobs.kernels.triton.sharded_kernels import (  # (launched by the ops)
    _global_lse_kernel as _global_lse_kernel,
)
from helios_logprobs.kernels.triton.sharded_kernels import (
    _shard_merge_kernel as _shard_merge_kernel,
)
from helios_logprobs.kernels.triton.sharded_kernels import (
    _shard_stats_kernel as _shard_stats_kernel,
)
from helios_logprobs.kernels.triton.sharded_kernels import (
    _sharded_final_kernel as _sharded_final_kernel,
)

# --------------------------------------------------------------------------------------------
# Prepared launches
# --------------------------------------------------------------------------------------------


class PreparedShardedReduction(PreparedWorkspaces):
    """The six launches for up to ``rows`` rows of a ``width``-lane shard of ``dtype`` on
    ``device``, owning the tile-statistics and candidate-key workspaces.

    Calls allocate nothing (except that a ``shard_starts`` given as a Python sequence is
    copied to the device once and cached); with ``warmup=True`` the constructor compiles all
    six kernels for int32 and int64 ``chosen`` before the first call.
    """

    def __init__(
        self,
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        block_size: int | None = None,
        merge_block: int | None = None,
        select: int | None = None,
        warmup: bool = True,
    ) -> None:
        super().__init__(rows, width, dtype, device, block_size=block_size,
                         merge_block=merge_block, select=select, size_error="rows, width >= 1")
        self._starts: dict[tuple[int, ...], torch.Tensor] = {}
        if warmup:
            self._warmup()

    def _warmup_launch(self, logits, chosen, requested) -> None:
        dev = self.device
        e1 = torch.zeros(1, 1, EXCHANGE1_WORDS, dtype=torch.int32, device=dev)
        e2 = torch.zeros(1, 1, EXCHANGE2_WORDS, dtype=torch.int32, device=dev)
        lse = torch.zeros(1, dtype=torch.float32, device=dev)
        out = torch.zeros(1, PAYLOAD_WORDS, dtype=torch.int32, device=dev)
        starts = self.starts_tensor([0, self.width])
        ids, counts = self.no_ids[:1], self.no_counts[:1]
        self._stats(logits, requested, self.width, e1[0])
        self._candidates(logits, chosen, ids, counts, requested, e1, 0, self.width, lse, e2[0])
        self._final(e2, lse, chosen, ids, counts, requested, 1, starts, out)

    def starts_tensor(self, shard_starts: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if isinstance(shard_starts, torch.Tensor):
            return shard_starts
        key = tuple(int(s) for s in shard_starts)
        t = self._starts.get(key)
        if t is None:
            t = torch.tensor(key, dtype=torch.int64, device=self.device)
            self._starts[key] = t
        return t

    def _check_shard(self, logits: torch.Tensor, local_valid: int) -> int:
        rows = self._check_logits(logits)
        if not 0 <= local_valid <= logits.shape[1]:
            raise ValueError(f"local_valid: expected 0..{logits.shape[1]}, got {local_valid}")
        return rows

    # ---------------------------------------------------------------- launches 1-2
    def stats(
        self,
        logits: torch.Tensor,
        requested: torch.Tensor,
        local_valid: int,
        e1_out: torch.Tensor,
    ) -> torch.Tensor:
        rows = self._check_shard(logits, local_valid)
        check_vector("requested", requested, rows, FLAG_DTYPES, self.device)
        check_matrix("e1_out", e1_out, (rows, EXCHANGE1_WORDS), torch.int32, self.device)
        if rows:
            self._stats(logits, requested, local_valid, e1_out)
        return e1_out

    def _stats(self, logits, requested, local_valid, e1_out) -> None:
        # (helios::triton_shard_stats: kernels/triton/ops.py)
        triton_shard_stats(logits, requested, local_valid, self.block_size, self.block_tiles,
                           self.tile_max, self.tile_mass, e1_out)

    # ---------------------------------------------------------------- launches 3-5
    def candidates(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        ids: torch.Tensor | None,
        counts: torch.Tensor | None,
        requested: torch.Tensor,
        e1_all: torch.Tensor,
        vocab_start: int,
        local_valid: int,
        lse_out: torch.Tensor,
        e2_out: torch.Tensor,
    ) -> torch.Tensor:
        rows = self._check_shard(logits, local_valid)
        if vocab_start < 0:
            raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
        ids, counts = self._check_request(chosen, ids, counts, requested, rows)
        if e1_all.dim() != 3 or e1_all.shape[0] < 1:
            raise ValueError(f"e1_all: expected [world, rows, 2], got {tuple(e1_all.shape)}")
        check_matrix("e1_all", e1_all, (e1_all.shape[0], rows, EXCHANGE1_WORDS), torch.int32,
                     self.device)
        check_vector("lse_out", lse_out, rows, (torch.float32,), self.device)
        check_matrix("e2_out", e2_out, (rows, EXCHANGE2_WORDS), torch.int32, self.device)
        if rows:
            self._candidates(logits, chosen, ids, counts, requested, e1_all, vocab_start,
                             local_valid, lse_out, e2_out)
        return e2_out

    def _candidates(self, logits, chosen, ids, counts, requested, e1_all, vocab_start,
                    local_valid, lse_out, e2_out) -> None:
        # Launch 3: global lse from every rank's exchange-1 words, in rank order; launch 4:
        # per-tile best 32 keys with global ids vocab_start + lane; launch 5: the shard's
        # exchange-2 row (layout in _shard_merge_kernel). helios::triton_shard_candidates.
        triton_shard_candidates(logits, chosen, ids, counts, requested, e1_all, vocab_start,
                                local_valid, self.block_size, self.merge_block, self.select,
                                self.cand, lse_out, e2_out)

    # ---------------------------------------------------------------- launch 6
    def final(
        self,
        e2_all: torch.Tensor,
        lse: torch.Tensor,
        chosen: torch.Tensor,
        ids: torch.Tensor | None,
        counts: torch.Tensor | None,
        requested: torch.Tensor,
        k: int,
        shard_starts: torch.Tensor | Sequence[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        # Checked against lse's device and row count, not this object's configuration.
        starts = self.starts_tensor(shard_starts)
        device = lse.device
        rows = lse.shape[0] if lse.dim() == 1 else -1
        if e2_all.dim() != 3 or e2_all.shape[0] < 1:
            raise ValueError(f"e2_all: expected [world, rows, 129], got {tuple(e2_all.shape)}")
        world = e2_all.shape[0]
        check_matrix("e2_all", e2_all, (world, rows, EXCHANGE2_WORDS), torch.int32, device)
        check_vector("lse", lse, rows, (torch.float32,), device)
        ids, counts = check_request(chosen, ids, counts, requested, rows, device, self.no_ids,
                                    self.no_counts)
        check_vector("shard_starts", starts, world + 1, (torch.int64,), device)
        check_k(k)
        check_matrix("out", out, (rows, PAYLOAD_WORDS), torch.int32, device)
        if rows:
            self._final(e2_all, lse, chosen, ids, counts, requested, k, starts, out)
        return out

    def _final(self, e2_all, lse, chosen, ids, counts, requested, k, starts, out) -> None:
        triton_final_merge(e2_all, lse, chosen, ids, counts, requested, starts, k, self.select,
                           out)  # (helios::triton_final_merge)


# --------------------------------------------------------------------------------------------
# The driver's entry points (kernels/sharded.py)
# --------------------------------------------------------------------------------------------

_PREPARED: dict[tuple, list[PreparedShardedReduction]] = {}


def prepared_sharded(
    rows: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> PreparedShardedReduction:
    """The cached PreparedShardedReduction for (width, dtype, device) with capacity >= rows
    (call once with the largest row count before capture; earlier objects stay alive)."""
    return PreparedShardedReduction.cached(_PREPARED, rows, width, dtype, device)


def _any_prepared(rows: int, device: torch.device) -> PreparedShardedReduction | None:
    for (dev, _, _), entries in _PREPARED.items():
        for prepared in entries:
            if dev == device and prepared.rows >= rows:
                return prepared
    return None


def shard_stats(
    logits: torch.Tensor, request: RowRequest, local_valid: int, e1_out: torch.Tensor
) -> torch.Tensor:
    """Launches 1-2: e1_out int32 [rows, 2] = (shard max, shard exp mass) as FP32 bits."""
    prepared = PreparedShardedReduction.cached_for(_PREPARED, logits)
    return prepared.stats(logits, request.requested, local_valid, e1_out)


def shard_candidates(
    logits: torch.Tensor,
    request: RowRequest,
    e1_all: torch.Tensor,
    vocab_start: int,
    local_valid: int,
    lse_out: torch.Tensor,
    e2_out: torch.Tensor,
) -> torch.Tensor:
    """Launches 3-5: lse_out fp32 [rows] (bit-identical on every rank) and e2_out int32
    [rows, 129] (layout in _shard_merge_kernel) from e1_all int32 [world, rows, 2]."""
    prepared = PreparedShardedReduction.cached_for(_PREPARED, logits)
    return prepared.candidates(logits, request.chosen, request.ids, request.counts,
                               request.requested, e1_all, vocab_start, local_valid, lse_out,
                               e2_out)


def final_merge(
    e2_all: torch.Tensor,
    lse: torch.Tensor,
    request: RowRequest,
    shard_starts: torch.Tensor | Sequence[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """Launch 6: the packed payload out int32 [rows, 258], identical on every rank.

    shard_starts: world + 1 ints (last = vocab_size), an int64 device tensor or a sequence
    (copied to the device once per distinct value and cached)."""
    rows = lse.shape[0]
    prepared = _any_prepared(rows, lse.device)
    if prepared is None:
        prepared = prepared_sharded(max(rows, 1), TILE_CANDIDATES, torch.float32, lse.device)
    return prepared.final(e2_all, lse, request.chosen, request.ids, request.counts,
                          request.requested, request.k, shard_starts, out)
