"""The public reduction entry points: argument validation, then dispatch to a backend.

- ``reduce_logprobs``: one rank holds the whole vocabulary row.
- ``reduce_logprobs_sharded``: each rank holds a vocabulary shard; six launches, two
  fixed-width exchanges (kernels/sharded.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from helios_logprobs.kernels.backends import BACKENDS, SHARDED_BACKENDS, require_triton_device
from helios_logprobs.kernels.cpu.backend import reduce_torch
from helios_logprobs.kernels.layout import EXPORT_K, MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.rows import RowRequest


def pack_token_ids(
    token_ids: Sequence[Sequence[int]] | None, rows: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row caller IDs -> (ids int32 [rows, 128] padded with -1, counts int32 [rows])."""
    if token_ids is None:
        return torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32), torch.zeros(
            rows, dtype=torch.int32)
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    if len(token_ids) != rows:
        raise ValueError(f"token_ids: expected {rows} rows, got {len(token_ids)}")
    for row, row_ids in enumerate(token_ids):
        row_ids = [int(t) for t in row_ids]
        if len(row_ids) > MAX_TOKEN_IDS:
            raise ValueError(f"token_ids[{row}]: at most {MAX_TOKEN_IDS} ids, got {len(row_ids)}")
        if len(set(row_ids)) != len(row_ids):
            raise ValueError(f"token_ids[{row}]: ids must be distinct")
        bad = [t for t in row_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids[{row}]: ids {bad} outside vocabulary [0, {vocab_size})")
        ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        counts[row] = len(row_ids)
    return ids, counts


def check_common(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    k: int,
    vocab_size: int,
    requested: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float [rows, width] tensor, got {logits.shape}")
    rows = logits.shape[0]
    if chosen.shape != (rows,):
        raise ValueError(f"chosen: expected shape ({rows},), got {tuple(chosen.shape)}")
    if not 0 <= k <= EXPORT_K:
        raise ValueError(f"k: expected 0..{EXPORT_K}, got {k}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
    if requested is None:
        requested = _defaults(rows, logits.device)[2]
    elif requested.shape != (rows,):
        raise ValueError(f"requested: expected shape ({rows},), got {tuple(requested.shape)}")
    if out is None:
        out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32, device=logits.device)
    elif out.shape != (rows, PAYLOAD_WORDS) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(
            f"out: expected contiguous int32 ({rows}, {PAYLOAD_WORDS}), "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    return requested, out


def check_chosen(chosen: torch.Tensor, requested: torch.Tensor, vocab_size: int) -> None:
    """Chosen ids of requesting rows must be vocabulary ids (padding lanes are not tokens)."""
    if chosen.dtype.is_floating_point or chosen.dtype == torch.bool:
        raise ValueError(f"chosen: expected an integer tensor, got {chosen.dtype}")
    if chosen.device.type == "cpu" and requested.device.type == "cpu":  # (no tensor ops)
        for row, (token, flag) in enumerate(zip(chosen.tolist(), requested.tolist(),
                                                strict=True)):
            if flag and not 0 <= token < vocab_size:
                raise ValueError(f"chosen[{row}] = {token} outside vocabulary [0, {vocab_size})")
        return
    live = requested != 0
    bad = live & ((chosen < 0) | (chosen >= vocab_size))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"chosen[{row}] = {int(chosen[row])} outside vocabulary [0, {vocab_size})"
        )


def reduce_logprobs(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    *,
    k: int = EXPORT_K,
    token_ids: Sequence[Sequence[int]] | None = None,
    vocab_size: int | None = None,
    requested: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Packed logprobs, int32 [rows, PAYLOAD_WORDS], of full-vocabulary logit rows.

    Per written row: chosen id, chosen FP32 logprob bits, then K natural alternatives (value
    descending, id ascending on the reported FP32 value) or, for a row with token_ids, those
    IDs in caller order. Reported value = float32(logit) - lse with lse from FP32 tile
    maxima and masses; lanes >= vocab_size (padding) never enter. A non-finite lse (NaN or
    +inf logit, or every logit -inf) gives a NaN chosen value (and NaN selected values);
    the torch backends then report no natural alternatives (ids -1). Unused words of a
    written row are -1 (both words of a missing pair when the vocabulary has fewer than K
    ids). Natural values are decoded from the sort keys, so a reported -0.0 reads +0.0.
    Rows whose ``requested`` flag is 0 are neither read nor written; a fresh ``out`` is
    filled with -1. backend: "torch" (CPU production path), "reference" (slow oracle) or
    "triton" (kernels/triton/backend.py, imported on first use).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    width = logits.shape[-1] if logits.dim() == 2 else 0
    vocab = width if vocab_size is None else int(vocab_size)
    requested, out = check_common(logits, chosen, k, vocab, requested, out)
    if vocab > width:
        raise ValueError(f"vocab_size {vocab} exceeds the logits width {width}")
    check_chosen(chosen, requested, vocab)
    if backend == "reference":
        from helios_logprobs.kernels.reference import reduce_reference

        rows_ids = None if token_ids is None else [list(t) for t in token_ids]
        pack_token_ids(rows_ids, logits.shape[0], vocab)  # same validation as the others
        return reduce_reference(
            logits, chosen, k=k, token_ids=rows_ids, vocab_size=vocab, requested=requested,
            out=out,
        )
    request = row_request(chosen, token_ids, requested, k, vocab, logits.device)
    if backend == "torch":
        return reduce_torch(logits, request, vocab, out)
    require_triton_device(logits.device)
    from helios_logprobs.kernels.triton.backend import reduce_triton

    return reduce_triton(logits, request, vocab, out)



def reduce_logprobs_sharded(
    local_logits: torch.Tensor,
    chosen: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: object,
    k: int = EXPORT_K,
    token_ids: Sequence[Sequence[int]] | None = None,
    requested: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Packed logprobs of vocabulary-sharded rows: the same int32 [rows, PAYLOAD_WORDS] on
    every rank as ``reduce_logprobs`` on the full row (within FP32 tolerance).

    ``local_logits`` [rows, width] holds global ids [vocab_start, vocab_start + width); lanes
    at or beyond ``vocab_size`` are padding. Every rank of ``group`` (None: no group) must
    call with the same rows, chosen, token_ids, requested, k and backend. Six launches and
    two fixed-width exchanges per call; prepared state is cached per configuration.
    """
    if backend not in SHARDED_BACKENDS:
        raise ValueError(f"backend: expected one of {SHARDED_BACKENDS}, got {backend!r}")
    requested, out = check_common(local_logits, chosen, k, vocab_size, requested, out)
    if vocab_start < 0:
        raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
    check_chosen(chosen, requested, vocab_size)
    rows, width = local_logits.shape
    request = row_request(chosen, token_ids, requested, k, vocab_size, local_logits.device)
    from helios_logprobs.kernels.sharded import prepared_reduction

    prepared = prepared_reduction(
        group, rows, width, vocab_start, vocab_size, backend, local_logits.device,
        local_logits.dtype,
    )
    return prepared(local_logits, request, out)


def row_request(
    chosen: torch.Tensor,
    token_ids: Sequence[Sequence[int]] | None,
    requested: torch.Tensor,
    k: int,
    vocab_size: int,
    device: torch.device,
) -> RowRequest:
    if token_ids is None:
        ids, counts, _ = _defaults(chosen.shape[0], device)
        return RowRequest(chosen, ids, counts, requested, k)
    ids, counts = pack_token_ids(token_ids, chosen.shape[0], vocab_size)
    return RowRequest(chosen, ids.to(device), counts.to(device), requested, k)


@functools.lru_cache(maxsize=16)
def _defaults(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(no selected ids, zero counts, every row requested) for calls that pass none; shared
    between calls and never written (the backends only read a RowRequest)."""
    ids, counts = pack_token_ids(None, rows, 1)
    return (ids.to(device), counts.to(device),
            torch.ones(rows, dtype=torch.int32, device=device))
