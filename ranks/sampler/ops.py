"""The capture-safe sampler's launches as custom ops (``torch.library``), so that a compiled
sample phase (``torch.compile(fullgraph=True)``) treats each as one opaque node, as the
reduction's launches are (kernels/cpu/ops.py).

- ``helios::sample_scale``: the scratch copy of logit rows (NaN as -inf), divided by each
  row's temperature (1 for greedy rows) unless logits processors run first: writes the
  scratch rows.
- ``helios::sample_best``: each scratch row's best (score key, global id) on this shard: the
  argmax of greedy rows, the exhaustive Gumbel-max of the others (every lane's noise drawn:
  ranks/sampler/gumbel.py exact_gumbel_best): writes the keys and ids.
- ``helios::sample_argmax``: ``sample_best`` for a bucket whose rows are all greedy (no
  noise drawn): writes the keys and ids.
- ``helios::sample_pick``: the rows' ids as tokens (one rank: its best is the pick; the pick
  exchange of several ranks stays in ShardedSampler): writes the token buffer.

Their declared mutations give the compiler the scratch -> best -> pick order; the fake
implementations write nothing and return nothing (every output is a buffer the caller sized).
``sample_rows`` composes them for a bucket of rows given as tensors only (temperatures,
greedy flags, seeds, positions), so one compiled graph serves every row count of a bucket and
every mix of greedy and temperature rows without recompiling.
"""

from __future__ import annotations

import torch

from helios_logprobs.ranks.sampler.filters import greedy_best
from helios_logprobs.ranks.sampler.gumbel import exact_gumbel_best
from helios_logprobs.ranks.sampler.processors import NEG_INF


@torch.library.custom_op("helios::sample_scale", mutates_args=("out",))
def sample_scale(logits: torch.Tensor, scale: torch.Tensor, divide: bool,
                 out: torch.Tensor) -> None:
    """out = rows of logits, NaN as -inf, divided by scale (float32 [rows]) where ``divide``
    (else the copy only: the logits processors run before the temperature)."""
    if logits.dtype == out.dtype:
        torch.nan_to_num(logits, nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF, out=out)
    else:
        out.copy_(logits).nan_to_num_(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    if divide:
        out.div_(scale.unsqueeze(1))


@sample_scale.register_fake
def _(logits, scale, divide, out) -> None:
    return None


@torch.library.custom_op("helios::sample_best", mutates_args=("keys_out", "ids_out"))
def sample_best(x: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor, lane_ids: torch.Tensor, vocab_start: int,
                keys_out: torch.Tensor, ids_out: torch.Tensor) -> None:
    """Best (score key, global id) of each row of x [rows, local_valid]: the argmax where
    ``greedy`` (bool [rows]), else the Gumbel-max keyed by (seed, position, lane_ids: the
    lanes' global ids, vocab_start onwards)."""
    drawn_keys, drawn_ids = exact_gumbel_best(x, seeds, positions, lane_ids)
    argmax_keys, argmax_ids = greedy_best(x, vocab_start)
    keys_out.copy_(torch.where(greedy, argmax_keys, drawn_keys))
    ids_out.copy_(torch.where(greedy, argmax_ids, drawn_ids))


@sample_best.register_fake
def _(x, greedy, seeds, positions, lane_ids, vocab_start, keys_out, ids_out) -> None:
    return None


@torch.library.custom_op("helios::sample_argmax", mutates_args=("keys_out", "ids_out"))
def sample_argmax(x: torch.Tensor, vocab_start: int, keys_out: torch.Tensor,
                  ids_out: torch.Tensor) -> None:
    """sample_best of rows that are all greedy: the argmax alone (no noise drawn)."""
    keys, ids = greedy_best(x, vocab_start)
    keys_out.copy_(keys)
    ids_out.copy_(ids)


@sample_argmax.register_fake
def _(x, vocab_start, keys_out, ids_out) -> None:
    return None


@torch.library.custom_op("helios::sample_pick", mutates_args=("tokens",))
def sample_pick(ids: torch.Tensor, tokens: torch.Tensor) -> None:
    tokens.copy_(ids)


@sample_pick.register_fake
def _(ids, tokens) -> None:
    return None


def sample_rows(logits: torch.Tensor, scale: torch.Tensor, greedy: torch.Tensor,
                seeds: torch.Tensor, positions: torch.Tensor, lane_ids: torch.Tensor,
                vocab_start: int, scratch: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor,
                tokens: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [rows, local_valid] at one rank (rows without a processor
    or filter: greedy, or temperature only), written into ``tokens`` [rows]: the three ops
    over buffers the caller sized (scratch [rows, local_valid], keys and ids [rows])."""
    sample_scale(logits, scale, True, scratch)
    sample_best(scratch, greedy, seeds, positions, lane_ids, vocab_start, keys, ids)
    sample_pick(ids, tokens)
    return tokens
