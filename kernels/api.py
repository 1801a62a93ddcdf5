"""Validation and dispatch for the public reduction entry points, and the packed-payload
assembly shared by the torch paths (kernels/torch_backend.py, kernels/torch_sharded.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kernels.layout import (
    CHOSEN_BITS,
    CHOSEN_ID,
    EXPORT_K,
    FIRST_PAIR,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
)
from kernels.sortkeys import EMPTY_KEY, float_bits, key_ids, key_values

BACKENDS = ("reference", "torch", "triton")


def pack_token_ids(
    token_ids: Sequence[Sequence[int]] | None, rows: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row caller IDs -> (ids int32 [rows, 128] padded with -1, counts int32 [rows])."""
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    if token_ids is None:
        return ids, counts
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
        requested = torch.ones(rows, dtype=torch.int32, device=logits.device)
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
    "triton" (kernels/triton_backend.py, imported on first use).
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
        from kernels.reference import reduce_reference

        rows_ids = None if token_ids is None else [list(t) for t in token_ids]
        pack_token_ids(rows_ids, logits.shape[0], vocab)  # same validation as the others
        return reduce_reference(
            logits, chosen, k=k, token_ids=rows_ids, vocab_size=vocab, requested=requested,
            out=out,
        )
    ids, counts = pack_token_ids(token_ids, logits.shape[0], vocab)
    ids, counts = ids.to(logits.device), counts.to(logits.device)
    if backend == "torch":
        from kernels.torch_backend import reduce_torch

        return reduce_torch(logits, chosen, ids, counts, requested, k, vocab, out)
    require_triton_device(logits.device)
    from kernels.triton_backend import reduce_triton

    return reduce_triton(logits, chosen, ids, counts, requested, k, vocab, out)


def require_triton_device(device: torch.device | str) -> None:
    """Triton kernels need a GPU, or the interpreter for CPU tensors (tests, debugging)."""
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
            "imported; use backend='torch' for the CPU production path"
        )


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
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: expected 'torch' or 'triton', got {backend!r}")
    requested, out = check_common(local_logits, chosen, k, vocab_size, requested, out)
    if vocab_start < 0:
        raise ValueError(f"vocab_start: expected >= 0, got {vocab_start}")
    check_chosen(chosen, requested, vocab_size)
    rows, width = local_logits.shape
    ids, counts = pack_token_ids(token_ids, rows, vocab_size)
    ids, counts = ids.to(local_logits.device), counts.to(local_logits.device)
    from kernels.sharded import prepared_reduction

    prepared = prepared_reduction(
        group, rows, width, vocab_start, vocab_size, backend, local_logits.device,
        local_logits.dtype,
    )
    return prepared(local_logits, chosen, ids, counts, requested, k, out)


# Packed payload assembly (torch paths).


def flagged_rows(flags: torch.Tensor) -> torch.Tensor | None:
    """int64 indices of the True rows, or None when every row is flagged (slices then)."""
    if bool(flags.all()):
        return None
    return flags.nonzero().flatten()


def top_keys(candidates: torch.Tensor, k: int) -> torch.Tensor:
    """[n, m] int64 keys -> [n, k] best keys, best first (EMPTY_KEY pads when m < k)."""
    n, m = candidates.shape
    best = candidates.topk(min(k, m), dim=1, sorted=True).values
    if best.shape[1] < k:
        pad = torch.full((n, k - best.shape[1]), EMPTY_KEY, dtype=torch.int64, device=best.device)
        best = torch.cat((best, pad), dim=1)
    return best


def assemble_payload(
    chosen: torch.Tensor,
    chosen_values: torch.Tensor,
    natural: torch.Tensor,
    best: torch.Tensor | None,
    picked: torch.Tensor,
    sel: torch.Tensor,
    sel_counts: torch.Tensor,
    sel_values: torch.Tensor,
) -> torch.Tensor:
    """int32 [n, PAYLOAD_WORDS]: chosen id and FP32 bits, then (id, FP32 bits) pairs.

    Rows ``natural`` get the keys ``best`` [len(natural), k], best first (an EMPTY_KEY slot,
    vocabulary < K, gives -1, -1; values are decoded from the keys, so -0.0 reads +0.0).
    Rows ``picked`` get ids ``sel`` [len(picked), 128] with ``sel_values``, in caller order,
    -1 beyond each of ``sel_counts``. Every other word is -1.
    """
    n = chosen.numel()
    payload = torch.full((n, PAYLOAD_WORDS), -1, dtype=torch.int32, device=chosen.device)
    payload[:, CHOSEN_ID] = chosen.to(torch.int32)
    payload[:, CHOSEN_BITS] = float_bits(chosen_values)
    pairs = payload[:, FIRST_PAIR:].view(n, MAX_TOKEN_IDS, 2)
    if best is not None and best.shape[1]:
        k, empty = best.shape[1], best == EMPTY_KEY
        pairs[natural, :k, 0] = torch.where(empty, -1, key_ids(best)).to(torch.int32)
        pairs[natural, :k, 1] = torch.where(empty, -1, float_bits(key_values(best)))
    if picked.numel():
        live = torch.arange(MAX_TOKEN_IDS, device=sel.device) < sel_counts.unsqueeze(1)
        pairs[picked, :, 0] = torch.where(live, sel.to(torch.int32), -1)
        pairs[picked, :, 1] = torch.where(live, float_bits(sel_values), -1)
    return payload


def write_rows(out: torch.Tensor, rows: torch.Tensor | None, payload: torch.Tensor) -> None:
    if rows is None:
        out.copy_(payload)
    else:
        out.index_copy_(0, rows, payload)


def pick_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The flagged rows of a per-row tensor (itself when every row is flagged)."""
    return t if rows is None else t.index_select(0, rows)
