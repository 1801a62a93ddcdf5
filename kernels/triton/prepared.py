"""Host-side geometry, workspaces and argument checks shared by the Triton launchers.

``kernels/triton/backend.py`` (``PreparedReduction``, one rank holds the whole row) and
``kernels/triton/sharded.py`` (``PreparedShardedReduction``, vocabulary shards) both derive
from ``PreparedWorkspaces``: the block size, tile count and merge block for a (rows, width,
dtype, device, select) configuration, the tile-statistics and candidate-key workspaces, the
"no selected IDs" buffers, the warm-up loop and the launches of the two shared tile kernels
(kernels/triton/common.py). Nothing here is a ``@triton.jit`` function.
"""

from __future__ import annotations

import torch

import triton
from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, TILE_CANDIDATES
from helios_logprobs.kernels.triton.common import (
    RANK_MAX_BLOCK,
    SELECT_RANK,
    SELECTS,
    default_select,
    next_power_of_2,
    tile_keys_kernel,
    tile_stats_kernel,
)

DEFAULT_BLOCK_SIZE = 4096
"""Vocabulary lanes per tile (a power of two >= 32). 151,936 lanes -> 38 tiles per row."""
MAX_MERGE_BLOCK = 1024
"""Candidate keys the final merge loads per step (rows with more candidates loop); also the
largest block SELECT_RANK accepts."""
GPU_MERGE_BLOCK = 256
MAX_BLOCK_TILES = 1024
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
FLAG_DTYPES = (torch.int32, torch.int64, torch.bool)
"""int32 is the contract's flag dtype (warmed up); the others compile on first use."""


# --------------------------------------------------------------------------------------------
# Launcher checks
# --------------------------------------------------------------------------------------------


def check_logits(logits: torch.Tensor, device: torch.device | None = None) -> None:
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(
            f"logits: expected fp32/bf16/fp16 [rows, width], got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits: last dimension must be contiguous, strides {logits.stride()}")
    if logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]:
        raise ValueError(f"logits: row stride {logits.stride(0)} < width {logits.shape[1]}")
    if device is not None and logits.device != device:
        raise ValueError(f"logits: expected device {device}, got {logits.device}")


def check_vector(
    name: str, t: torch.Tensor, rows: int, dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    if t.shape != (rows,) or t.dtype not in dtypes:
        raise ValueError(
            f"{name}: expected {' or '.join(str(d) for d in dtypes)} ({rows},), "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    if rows > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous vector, stride {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_matrix(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """Row-major matrix/tensor: exact shape and dtype, last dim contiguous, rows may be
    strided (a prefix view of a larger buffer is fine)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_selection(
    ids: torch.Tensor, counts: torch.Tensor, rows: int, device: torch.device
) -> None:
    check_matrix("ids", ids, (rows, MAX_TOKEN_IDS), torch.int32, device)
    check_vector("counts", counts, rows, (torch.int32,), device)


def check_k(k: int) -> None:
    if not 0 <= k <= TILE_CANDIDATES:
        raise ValueError(f"k: expected 0..{TILE_CANDIDATES}, got {k}")


def check_request(
    chosen: torch.Tensor,
    ids: torch.Tensor | None,
    counts: torch.Tensor | None,
    requested: torch.Tensor,
    rows: int,
    device: torch.device,
    no_ids: torch.Tensor,
    no_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the per-row request tensors; returns (ids, counts), where both None means the
    first ``rows`` rows of ``no_ids``/``no_counts`` (natural alternatives only)."""
    if (ids is None) != (counts is None):
        raise ValueError("ids and counts: pass both or neither")
    if ids is None:
        if no_ids.shape[0] < rows:
            raise ValueError(f"ids: required for {rows} rows (prepared for {no_ids.shape[0]})")
        ids, counts = no_ids[:rows], no_counts[:rows]
    check_selection(ids, counts, rows, device)
    check_vector("chosen", chosen, rows, INDEX_DTYPES, device)
    check_vector("requested", requested, rows, FLAG_DTYPES, device)
    return ids, counts


def normalize_device(device: torch.device | str) -> torch.device:
    """'cuda' -> 'cuda:<current>', so that it compares equal to a tensor's device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------


def pick_block_size(width: int, block_size: int | None, select: int) -> int:
    if block_size is None:
        cap = RANK_MAX_BLOCK if select == SELECT_RANK else DEFAULT_BLOCK_SIZE
        block_size = min(cap, max(next_power_of_2(width), TILE_CANDIDATES))
    if block_size < TILE_CANDIDATES or block_size & (block_size - 1):
        raise ValueError(
            f"block_size: expected a power of two >= {TILE_CANDIDATES}, got {block_size}"
        )
    if select == SELECT_RANK and block_size > RANK_MAX_BLOCK:
        raise ValueError(f"block_size: SELECT_RANK supports at most {RANK_MAX_BLOCK}")
    return block_size


def pick_merge_block(n_cand: int, merge_block: int | None, select: int) -> int:
    if merge_block is None:
        # The interpreter pays per operation, so fewer, larger chunks; on a GPU 256-key
        # chunks keep the bitonic network small (the merge runs once per row).
        cap = MAX_MERGE_BLOCK if select == SELECT_RANK else GPU_MERGE_BLOCK
        merge_block = min(next_power_of_2(n_cand), cap)
    merge_block = max(merge_block, TILE_CANDIDATES)
    if merge_block & (merge_block - 1) or merge_block > MAX_MERGE_BLOCK:
        raise ValueError(
            f"merge_block: expected a power of two in [32, {MAX_MERGE_BLOCK}], got {merge_block}"
        )
    return merge_block


def pick_select(select: int | None) -> int:
    select = default_select() if select is None else int(select)
    if select not in SELECTS:
        raise ValueError(f"select: expected one of {SELECTS}, got {select}")
    return select


def tile_warps(block_size: int) -> int:
    return 8 if block_size >= 4096 else 4


def cached_prepared(cache: dict, key: tuple, rows: int, build):
    """The smallest cached object for key with capacity >= rows, else a new one."""
    entries = cache.setdefault(key, [])
    for prepared in entries:  # ascending capacity
        if prepared.rows >= rows:
            return prepared
    capacity = max(rows, 2 * entries[-1].rows) if entries else rows
    prepared = build(capacity)
    entries.append(prepared)
    return prepared


# --------------------------------------------------------------------------------------------
# Workspaces
# --------------------------------------------------------------------------------------------


class PreparedWorkspaces:
    """Geometry and workspaces for up to ``rows`` rows of ``width`` logits of ``dtype`` on
    ``device``: tile_max/tile_mass fp32 [rows, max_tiles], cand int64 [rows, max_tiles * 32],
    and no_ids/no_counts (used when the caller passes ids/counts as None).

    A subclass allocates its own extra workspaces after ``super().__init__`` and then calls
    ``self._warmup()`` if asked to; ``_warmup`` runs ``_warmup_launch`` on a gated-off row for
    int32 and int64 ``chosen`` with int32 flags, so every kernel is compiled before the first
    real call (and before CUDA-graph capture).
    """

    def __init__(
        self,
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        block_size: int | None,
        merge_block: int | None,
        select: int | None,
        size_error: str,
    ) -> None:
        name = type(self).__name__
        if rows < 1 or width < 1:
            raise ValueError(f"{name}: {size_error}, got {rows}, {width}")
        if dtype not in LOGIT_DTYPES:
            raise ValueError(f"{name}: unsupported logits dtype {dtype}")
        self.rows = rows
        self.width = width
        self.dtype = dtype
        self.device = normalize_device(device)
        self.select = pick_select(select)
        self.block_size = pick_block_size(width, block_size, self.select)
        self.max_tiles = triton.cdiv(width, self.block_size)
        self.block_tiles = min(next_power_of_2(self.max_tiles), MAX_BLOCK_TILES)
        n_cand = self.max_tiles * TILE_CANDIDATES
        self.merge_block = pick_merge_block(n_cand, merge_block, self.select)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.tile_max = torch.empty(rows, self.max_tiles, **f32)
        self.tile_mass = torch.empty(rows, self.max_tiles, **f32)
        self.cand = torch.empty(rows, n_cand, dtype=torch.int64, device=self.device)
        self.no_ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=self.device)
        self.no_counts = torch.zeros(rows, dtype=torch.int32, device=self.device)

    @classmethod
    def cached(
        cls, cache: dict, rows: int, width: int, dtype: torch.dtype, device: torch.device | str
    ):
        """The object in ``cache`` for (device, dtype, width) with capacity >= rows; a larger
        row count adds a new one (earlier ones stay alive, see ``cached_prepared``)."""
        device = normalize_device(device)
        return cached_prepared(cache, (device, dtype, width), rows,
                               lambda capacity: cls(capacity, width, dtype, device))

    @classmethod
    def cached_for(cls, cache: dict, logits: torch.Tensor):
        """``cached`` for the shape, dtype and device of ``logits`` (checked first)."""
        check_logits(logits)
        return cls.cached(cache, max(logits.shape[0], 1), logits.shape[1], logits.dtype,
                          logits.device)

    # ---------------------------------------------------------------- warm-up
    def _warmup(self) -> None:
        dev = self.device
        logits = torch.zeros(1, self.width, dtype=self.dtype, device=dev)
        requested = torch.zeros(1, dtype=torch.int32, device=dev)
        for chosen_dtype in INDEX_DTYPES:
            chosen = torch.zeros(1, dtype=chosen_dtype, device=dev)
            self._warmup_launch(logits, chosen, requested)

    def _warmup_launch(
        self, logits: torch.Tensor, chosen: torch.Tensor, requested: torch.Tensor
    ) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- checks
    def _check_logits(self, logits: torch.Tensor) -> int:
        """Checks ``logits`` against the prepared configuration; returns its row count."""
        check_logits(logits, self.device)
        rows, width = logits.shape
        if logits.dtype != self.dtype or width != self.width:
            raise ValueError(
                f"logits: prepared for {self.dtype} width {self.width}, "
                f"got {logits.dtype} width {width}"
            )
        if rows > self.rows:
            raise ValueError(f"logits: {rows} rows exceed the prepared capacity {self.rows}")
        return rows

    def _check_request(self, chosen, ids, counts, requested, rows: int):
        return check_request(chosen, ids, counts, requested, rows, self.device, self.no_ids,
                             self.no_counts)

    # ---------------------------------------------------------------- shared tile launches
    def _tile_stats(self, logits, requested, n_valid: int, n_tiles: int) -> None:
        """tile_stats_kernel over the first ``n_valid`` lanes into tile_max/tile_mass."""
        if n_tiles > 0:
            tile_stats_kernel[(logits.shape[0], n_tiles)](
                logits, logits.stride(0), requested,
                self.tile_max, self.tile_mass, self.tile_max.stride(0),
                n_valid,
                BLOCK_SIZE=self.block_size, num_warps=tile_warps(self.block_size),
            )

    def _tile_keys(self, logits, requested, counts, lse, n_valid: int, id_offset: int, k: int,
                   n_tiles: int) -> None:
        """tile_keys_kernel: each tile's best 32 keys (ids id_offset + lane) into cand."""
        if n_tiles > 0:
            tile_keys_kernel[(logits.shape[0], n_tiles)](
                logits, logits.stride(0), requested, counts, lse,
                self.cand, self.cand.stride(0),
                n_valid, id_offset, k,
                BLOCK_SIZE=self.block_size, SELECT=self.select,
                num_warps=tile_warps(self.block_size),
            )

