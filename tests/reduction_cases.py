"""Cases and checks for the Triton reductions, shared by the interpreter tests
(tests/unit/kernels/test_triton_reduction.py), the gloo tests
(tests/distributed/test_sharded_triton.py) and the GPU tests (tests/gpu/test_triton_gpu.py).

Two comparisons per case:
- with kernels.reference.reduce_reference (independent FP32 log-softmax): values within
  ATOL, ids exact wherever the reference values at that position differ by more than ATOL;
- bit-exact with the reference ranking recomputed from the kernel's own lse (reported value
  = float32(x) - lse exactly): this pins the sort keys, the tie rule (including ties that
  the subtraction creates) and every -1 word. The one documented difference: an
  alternative whose value is zero is reported as +0.0 (the key normalizes signed zero), the
  chosen pair keeps the exact sign.
"""

from __future__ import annotations

import torch

from helios_logprobs.kernels.layout import (
    EXCHANGE1_WORDS,
    EXCHANGE2_WORDS,
    MAX_TOKEN_IDS,
    PAYLOAD_WORDS,
)
from helios_logprobs.kernels.reference import reduce_reference, reference_ranking
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sortkeys import float_bits
from helios_logprobs.kernels.triton.sharded import final_merge, shard_candidates, shard_stats
from tests.devices import triton_device

DEVICE = triton_device()
"""Where the kernels run: the interpreter on CPU here; the GPU when the device check runs this
file without the interpreter. Inputs are built and compared on the CPU."""


ATOL = 1e-5


SENTINEL = 0x5A5A0000


NAN = float("nan")


INF = float("inf")


def sentinel_out(rows: int) -> torch.Tensor:
    """A recognizable pattern: rows the kernels must not touch keep it word for word."""
    return (SENTINEL + torch.arange(rows * PAYLOAD_WORDS, dtype=torch.int32)).view(
        rows, PAYLOAD_WORDS
    )


def pack(token_ids: list[list[int]] | None, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    for r, row_ids in enumerate(token_ids or []):
        ids[r, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        counts[r] = len(row_ids)
    return ids, counts


def values_with_lse(logits: torch.Tensor, vocab: int, lse: torch.Tensor) -> torch.Tensor:
    values = logits[:, :vocab].to(torch.float32) - lse[:, None]
    bad = ~torch.isfinite(lse)
    values[bad] = NAN
    return values


def exact_expected(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    token_ids: list[list[int]] | None,
    requested: torch.Tensor,
    k: int,
    vocab: int,
    lse: torch.Tensor,
    base: torch.Tensor,
) -> torch.Tensor:
    """The payload the kernels must produce bit for bit, given their own lse."""
    values = values_with_lse(logits, vocab, lse)
    out = base.clone()
    for row in range(logits.shape[0]):
        if int(requested[row]) == 0:
            continue
        out[row].fill_(-1)
        v = values[row]
        c = int(chosen[row])
        out[row, 0] = c
        out[row, 1] = float_bits(v[c : c + 1])[0]
        ids = token_ids[row] if token_ids is not None else []
        if ids:
            picked = torch.tensor(ids, dtype=torch.int64)
            pv = v[picked]
        else:
            picked = reference_ranking(v)[:k]
            pv = v[picked]
            pv = torch.where(pv == 0, torch.zeros_like(pv), pv)  # +0.0 from the key
        n = picked.numel()
        out[row, 2 : 2 + 2 * n : 2] = picked.to(torch.int32)
        out[row, 3 : 3 + 2 * n : 2] = float_bits(pv)
    return out


def assert_matches_reference(
    got: torch.Tensor,
    logits: torch.Tensor,
    chosen: torch.Tensor,
    token_ids: list[list[int]] | None,
    requested: torch.Tensor,
    k: int,
    vocab: int,
    base: torch.Tensor,
) -> None:
    """Tolerance comparison with the independent reference (its own logsumexp)."""
    ref = reduce_reference(
        logits, chosen, k=k, token_ids=token_ids, vocab_size=vocab, requested=requested,
        out=base.clone(),
    )
    full_values = values_with_lse(
        logits, vocab, torch.logsumexp(logits[:, :vocab].to(torch.float32), dim=-1)
    )
    for row in range(got.shape[0]):
        if int(requested[row]) == 0:
            assert torch.equal(got[row], base[row]), f"row {row}: unflagged row was written"
            continue
        g, r = got[row], ref[row]
        assert int(g[0]) == int(r[0])
        gv, rv = g[1::2].view(torch.float32), r[1::2].view(torch.float32)
        torch.testing.assert_close(gv, rv, atol=ATOL, rtol=0, equal_nan=True)
        gid, rid = g[2::2], r[2::2]
        ids_row = token_ids[row] if token_ids is not None else []
        if ids_row:
            assert torch.equal(gid, rid), f"row {row}: selected ids differ"
            continue
        for pos in torch.nonzero(gid != rid).flatten().tolist():
            a, b = int(gid[pos]), int(rid[pos])
            assert a >= 0 and b >= 0, f"row {row} pos {pos}: id {a} vs reference {b}"
            va, vb = full_values[row, a], full_values[row, b]
            assert abs(float(va - vb)) <= ATOL, (
                f"row {row} pos {pos}: id {a} ({float(va)}) vs reference {b} ({float(vb)})"
            )


def random_case(
    rows: int,
    vocab: int,
    width: int,
    dtype: torch.dtype,
    seed: int,
    *,
    flags: bool = True,
    selected: bool = True,
    garbage: bool = True,
):
    """Random logits (scale ~3, some -inf), padded lanes holding +inf/NaN garbage, a mix of
    zero flags and selected-ID rows (chosen absent, ids outside the top-K)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, width, generator=g) * 3
    if vocab > 4:
        ninf = torch.rand(rows, width, generator=g) < 0.05
        base[ninf] = -INF
    if garbage and width > vocab:
        pad = base[:, vocab:]
        pad[:, 0::2] = INF
        pad[:, 1::2] = NAN
    logits = base.to(dtype)
    chosen = torch.randint(0, vocab, (rows,), generator=g, dtype=torch.int32)
    requested = torch.ones(rows, dtype=torch.int32)
    if flags and rows > 1:
        requested[torch.rand(rows, generator=g) < 0.25] = 0
        requested[0] = 1
    token_ids = None
    if selected and rows > 1:
        token_ids = [[] for _ in range(rows)]
        for r in range(1, rows, 3):
            n = int(torch.randint(1, min(vocab, MAX_TOKEN_IDS) + 1, (1,), generator=g))
            perm = torch.randperm(vocab, generator=g)[:n].tolist()
            perm = [t for t in perm if t != int(chosen[r])] or perm
            token_ids[r] = perm
        if rows > 1 and token_ids[rows - 1] == [] and vocab >= MAX_TOKEN_IDS:
            token_ids[rows - 1] = torch.randperm(vocab, generator=g)[:MAX_TOKEN_IDS].tolist()
    return logits, chosen, token_ids, requested


def to_device(*tensors: torch.Tensor, device: torch.device = DEVICE) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def run_prepared(prepared, logits, chosen, token_ids, requested, k, vocab):
    """Run on the prepared object's device; return CPU (out, untouched base, lse)."""
    rows = logits.shape[0]
    ids, counts = pack(token_ids, rows)
    base = sentinel_out(rows)
    args = to_device(logits, chosen, ids, counts, requested, base, device=prepared.device)
    out = args[-1]
    prepared(*args[:4], args[4], k, vocab, out)
    return out.cpu(), base, prepared.lse[:rows].cpu()


def first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    diff = torch.nonzero(got != expected)
    if diff.numel() == 0:
        return "equal"
    r, w = diff[0].tolist()
    return (
        f"{diff.shape[0]} words differ; first at row {r} word {w}: got {int(got[r, w])}, "
        f"expected {int(expected[r, w])}; row got {got[r, :12].tolist()} "
        f"expected {expected[r, :12].tolist()}"
    )


def split_shards(logits: torch.Tensor, starts: list[int], width: int, garbage: float = NAN):
    shards = []
    for r in range(len(starts) - 1):
        n = starts[r + 1] - starts[r]
        local = torch.full((logits.shape[0], width), garbage, dtype=logits.dtype)
        local[:, :n] = logits[:, starts[r] : starts[r + 1]]
        shards.append((local, starts[r], n))
    return shards


def simulate_world(logits, starts, width, chosen, token_ids, requested, k, *, prepared=None,
                   starts_as_tensor=False):
    """shard_stats on every rank -> stack (all-gather 1) -> shard_candidates on every rank ->
    stack (all-gather 2) -> final_merge on every rank. Returns CPU tensors."""
    rows = logits.shape[0]
    world = len(starts) - 1
    ids, counts = pack(token_ids, rows)
    chosen, ids, counts, requested = to_device(chosen, ids, counts, requested)
    shards = [(local.to(DEVICE), start, n) for local, start, n in
              split_shards(logits, starts, width)]
    if prepared is not None:
        stats, cands, final = prepared.stats, prepared.candidates, prepared.final
    else:
        # The module-level shard steps take one RowRequest (kernels.backends.ShardSteps).
        def stats(local, req, n, e1_out):
            return shard_stats(local, RowRequest(chosen, ids, counts, req, k), n, e1_out)

        def cands(local, c, i, n_ids, req, e1_all, start, n, lse, e2_out):
            request = RowRequest(c, i, n_ids, req, k)
            return shard_candidates(local, request, e1_all, start, n, lse, e2_out)

        def final(e2_all, lse, c, i, n_ids, req, kk, starts_arg, out):
            return final_merge(e2_all, lse, RowRequest(c, i, n_ids, req, kk), starts_arg, out)
    e1 = []
    for local, _, n in shards:
        e1_out = torch.full((rows, EXCHANGE1_WORDS), 77, dtype=torch.int32, device=DEVICE)
        stats(local, requested, n, e1_out)
        e1.append(e1_out)
    e1_all = torch.stack(e1)
    lses, e2 = [], []
    for local, start, n in shards:
        lse = torch.full((rows,), 123.0, device=DEVICE)
        e2_out = torch.full((rows, EXCHANGE2_WORDS), 77, dtype=torch.int32, device=DEVICE)
        cands(local, chosen, ids, counts, requested, e1_all, start, n, lse, e2_out)
        lses.append(lse)
        e2.append(e2_out)
    e2_all = torch.stack(e2)
    starts_arg = (torch.tensor(starts, dtype=torch.int64, device=DEVICE) if starts_as_tensor
                  else starts)
    outs = []
    for r in range(world):
        out = sentinel_out(rows).to(DEVICE)
        final(e2_all, lses[r], chosen, ids, counts, requested, k, starts_arg, out)
        outs.append(out.cpu())
    return outs, [t.cpu() for t in lses], e1_all.cpu(), e2_all.cpu()
