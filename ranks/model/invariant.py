"""Batch-invariant numerics (``--batch-invariant``, vLLM's ``VLLM_BATCH_INVARIANT``): a token
row's hidden states, logits and logprobs are the same bits whatever else shares its forward.

Why it is needed: a BLAS picks its kernel by the row count (this repository's CPU, MKL on
AVX2: one row takes a GEMV, 2..11 rows leave a tail of up to three rows to a different kernel,
12 or more rows agree), and attention over a batch padded to its longest context sums
different lane counts. So a speculative round (N + 1 rows of one request) and plain decoding
(one row) round differently, and so do the same request alone and in a busy batch.

What this module does instead:
1. Linear layers: every call sees at least ``MIN_ROWS`` rows (zero rows pad a short batch).
   ``choose_linear`` probes the model's own weight shapes at load: a row computed alone and
   among 2 to 69 rows, at different places, must give the same bits.
   If the BLAS fails the probe, every call is cut into tiles of exactly ``MIN_ROWS`` rows
   (one batched GEMM of identical tiles: the same kernel for every row), probed again; a BLAS
   that fails both is refused with an error naming the shape.
2. Attention (``attention``): each row attends to its own slot's keys in blocks of
   ``KEY_BLOCK``. Every reduction runs over a contiguous innermost axis of fixed length (the
   head dimension, or one key block), and blocks are added in key order in Python: keys past a
   row's position contribute exact zeros, so a row's result does not depend on the longest
   context of its batch. Masked value lanes are zeroed first (a NaN left in a reused slot must
   not leak through 0 * NaN).
3. Row-parallel sums over tensor-parallel ranks: ``collectives.groups.all_reduce_sum_ordered``
   adds the ranks' partials in rank order (a ring all-reduce orders each chunk's sum by its
   place in the tensor, which moves with the row count).
RMSNorm, RoPE, SiLU and the logprob reduction already act row by row with fixed-length
reductions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

MIN_ROWS = 16
KEY_BLOCK = 64
ROW_BLOCK = 32
"""Rows attended together (bounds the [rows, heads, KEY_BLOCK, head_dim] product)."""

Linear = Callable[..., torch.Tensor]


class BatchInvarianceError(RuntimeError):
    """The device's matrix multiply is not row-invariant under either padding scheme."""


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    rows = x.shape[0]
    if rows >= MIN_ROWS:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, MIN_ROWS - rows)), weight, bias)[:rows]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    rows, width = x.shape
    tiles = -(-rows // MIN_ROWS)
    padded = F.pad(x, (0, 0, 0, tiles * MIN_ROWS - rows)).view(tiles, MIN_ROWS, width)
    shared = weight.t().expand(tiles, *weight.t().shape)
    out = torch.bmm(padded, shared).view(tiles * MIN_ROWS, -1)[:rows]
    return out if bias is None else out + bias


PROBE_COUNTS = (2, 3, 4, 5, 7, 11, 13, MIN_ROWS, MIN_ROWS + 1, 21, 37, 4 * MIN_ROWS + 5)
PROBE_OUTPUTS = 512
"""The probe multiplies by the weight's first rows only (an output column's sum does not
depend on how many columns there are), keeping the probe of a 151,936-wide head cheap."""


def _row_invariant(linear: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    generator = torch.Generator(device="cpu").manual_seed(0)
    width = weight.shape[1]
    weight = weight[:PROBE_OUTPUTS]
    bias = None if bias is None else bias[:PROBE_OUTPUTS]

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=generator).to(weight.device, weight.dtype)

    probe = rows(1)
    expected = linear(probe, weight, bias)[0]
    for count in PROBE_COUNTS:
        place = count - 1 if count % 2 else count // 2
        batch = rows(count)
        batch[place] = probe[0]
        if not torch.equal(linear(batch, weight, bias)[place], expected):
            return False
    return True


def choose_linear(layers: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> Linear:
    """The first scheme under which every (weight, bias) given is row-invariant."""
    distinct = {(tuple(w.shape), b is not None): (w, b) for w, b in layers}
    for linear in (padded_linear, tiled_linear):
        if all(_row_invariant(linear, w, b) for w, b in distinct.values()):
            return linear
    shapes = sorted(shape for shape, _ in distinct)
    raise BatchInvarianceError(
        f"--batch-invariant: this device's matmul gives different bits for the same row in "
        f"batches of different sizes, even in tiles of {MIN_ROWS} rows (weights {shapes})"
    )


def attention(
    q: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    groups: int,
) -> torch.Tensor:
    """q ``[rows, heads, head_dim]`` of tokens already written to the cache at (slot,
    position) -> ``[rows, heads, head_dim]``, causal over each row's own slot."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], ROW_BLOCK):
        part = slice(start, start + ROW_BLOCK)
        out[part] = _attend(q[part], positions[part], slots[part], cache_k, cache_v, groups)
    return out


def _attend(q, positions, slots, cache_k, cache_v, groups) -> torch.Tensor:
    rows, heads, head_dim = q.shape
    max_len = cache_k.shape[1]
    blocks = -(-(int(positions.max()) + 1) // KEY_BLOCK)
    qf = q.float().unsqueeze(2) * head_dim**-0.5
    lanes = torch.arange(KEY_BLOCK, device=q.device)
    scores, values, valid_lanes = [], [], []
    for block in range(blocks):
        keys = block * KEY_BLOCK + lanes
        valid = (keys[None, :] <= positions[:, None]) & (keys[None, :] < max_len)
        index = keys.clamp(max=max_len - 1)
        k = _by_head(cache_k[slots[:, None], index[None, :]], groups)
        v = cache_v[slots[:, None], index[None, :]].masked_fill(~valid[:, :, None, None], 0)
        s = (qf * k.float()).sum(-1)
        scores.append(s.masked_fill(~valid[:, None, :], float("-inf")))
        values.append(_by_head(v, groups).float().transpose(-1, -2).contiguous())
        valid_lanes.append(valid)
    top = torch.stack(scores).amax(dim=(0, 3), keepdim=True)[0]
    total = q.new_zeros(rows, heads, 1, dtype=torch.float32)
    acc = q.new_zeros(rows, heads, head_dim, dtype=torch.float32)
    for s, v in zip(scores, values, strict=True):
        p = torch.exp(s - top)
        total = total + p.sum(-1, keepdim=True)
        acc = acc + (p.unsqueeze(2) * v).sum(-1)
    return (acc / total).to(q.dtype)


def _by_head(blocked: torch.Tensor, groups: int) -> torch.Tensor:
    """``[rows, KEY_BLOCK, kv_heads, head_dim]`` -> ``[rows, heads, KEY_BLOCK, head_dim]``."""
    per_head = blocked.permute(0, 2, 1, 3)
    return per_head.repeat_interleave(groups, dim=1) if groups > 1 else per_head
