"""Backend-agnostic driver of the vocabulary-sharded reduction: six launches, two exchanges.

Each rank holds logits [rows, width] for global ids [vocab_start, vocab_start + width), of
which the first local_valid lanes are real vocabulary (the rest is padding). Per call:

  shard_stats       (launches 1-2)  -> exchange 1: EXCHANGE1_WORDS = 3 int32 words per row
  gather 1          [world, rows, 3]: word 0 = shard max FP32 bits, word 1 = shard exp mass
                    FP32 bits (relative to that max); (-inf, 0) from a shard with no lanes;
                    word 2 = the shard's entropy term (kernels/entropy.py), written only for
                    the rows whose entropy is asked for
  shard_candidates  (launches 3-5)  -> exchange 2: EXCHANGE2_WORDS = 129 int32 words per row
  gather 2          [world, rows, 129]: word 0 = chosen raw logit FP32 bits (owner's word
                    read), words 1..64 = best 32 sort keys as (high, low) halves (natural
                    rows) or words 1..count = selected IDs' raw logit bits (owner's read)
  final_merge       (launch 6)      -> the packed payload, identical on every rank

(3 + 129) * 4 = 528 bytes per position per rank; no vocabulary-sized row ever travels.

Two options serve ``--logprobs-mode`` and entropy (ranks/step/reduce.py): ``normalize=False``
reports the row's values themselves (the ``*_logits`` modes): the candidates and the final
merge read a constant exchange 1 whose global normalization is exactly 0 (rank 0 sends max
0 and mass 1, the others -inf and 0), so each value is x - 0 = x bit for bit, ordered as
the logprobs would be; the true statistics still travel for the entropy. A call with
``entropy_out`` also writes each flagged row's entropy of softmax(row) there (FP32).

One rank (a size-1 group) with the torch backend has nothing to exchange: it runs the
four-launch whole-vocabulary reduction (kernels/cpu/backend.py), which gives the same
payload bits without the shard steps' bookkeeping (about 0.3-0.8 ms less per decode step on
CPU). The Triton backend keeps its six prepared launches at any size (CUDA-graph capture).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from helios_logprobs.collectives.exchange import WordExchange
from helios_logprobs.collectives.groups import all_gather_object, group_size
from helios_logprobs.kernels.backends import (
    require_triton_device,
    shard_steps,
    whole_native_call,
    whole_reduction,
)
from helios_logprobs.kernels.entropy import combine_flagged, whole_flagged, write_entropy_word
from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS
from helios_logprobs.kernels.rows import RowRequest

if TYPE_CHECKING:
    from helios_logprobs.kernels.cpu.compiled import RepeatedCall

_CACHE_SIZE = 32
_cache: OrderedDict[tuple, PreparedShardedReduction] = OrderedDict()


def shard_bounds(vocab_start: int, local_valid: int, vocab_size: int) -> tuple[int, int]:
    """This rank's owned global range [lo, hi), clamped to the vocabulary."""
    lo = min(vocab_start, vocab_size)
    return lo, lo + local_valid


def agreed_shard_starts(
    group: object, vocab_start: int, local_valid: int, vocab_size: int, rows: int
) -> list[int]:
    """Every rank's owned range, gathered once (collective): non-empty shards must tile
    [0, vocab_size) in rank order. Returns world + 1 starts (an empty shard's start equals
    the next one's, so it owns no id)."""
    mine = (*shard_bounds(vocab_start, local_valid, vocab_size), vocab_size, rows)
    bounds = [tuple(b) for b in all_gather_object(mine, group)]
    if any(b[2] != vocab_size or b[3] != bounds[0][3] for b in bounds):
        raise ValueError(f"ranks disagree on vocab_size or rows: {bounds}")
    starts, cursor = [], 0
    for rank, (lo, hi, _, _) in enumerate(bounds):
        starts.append(cursor)
        if hi > lo:
            if lo != cursor:
                raise ValueError(f"rank {rank} shard [{lo}, {hi}) is not at {cursor}")
            cursor = hi
    if cursor != vocab_size:
        raise ValueError(f"shards cover [0, {cursor}), not [0, {vocab_size}): {bounds}")
    return [*starts, cursor]


class PreparedShardedReduction:
    """Built once per configuration (collective: every rank of the group constructs it at
    the same point); then each call runs six launches and exactly two exchanges."""

    def __init__(
        self,
        group: object,
        rows: int,
        width: int,
        vocab_start: int,
        local_valid: int,
        vocab_size: int,
        backend: str,
        device: torch.device | str,
        repeated: bool = False,
        normalize: bool = True,
    ) -> None:
        """``repeated``: every call passes the same logits, request and output tensors (the
        runtime's step reduction), so a one-rank group may prepare its arguments once.
        ``normalize``: False reports raw values (no lse subtracted)."""
        if not 0 <= local_valid <= width:
            raise ValueError(f"local_valid {local_valid} outside [0, {width}]")
        self.group = group
        self.rows = rows
        self.width = width
        self.vocab_start = vocab_start
        self.local_valid = local_valid
        self.vocab_size = vocab_size
        if backend == "triton":
            require_triton_device(device)
        self.backend = backend
        self.repeated = repeated
        self.steps = shard_steps(backend)
        self.world = group_size(group)
        self.normalize = normalize
        self.whole = whole_reduction(backend, repeated) if self.world == 1 and normalize \
            else None
        self.shard_starts = agreed_shard_starts(group, vocab_start, local_valid, vocab_size,
                                                rows)
        self.exchange1 = WordExchange(group, rows, EXCHANGE1_WORDS, device)
        self.exchange2 = WordExchange(group, rows, EXCHANGE2_WORDS, device)
        self.lse = torch.empty(rows, dtype=torch.float32, device=device)
        self.unit_e1 = None if normalize else unit_statistics(self.world, rows, device)

    def native_call(
        self, logits: torch.Tensor, request: RowRequest, out: torch.Tensor
    ) -> RepeatedCall | None:
        """The compiled C call that this one-rank driver makes over these buffers (prepared
        with ``repeated``), for a C caller that runs it between its own steps
        (ranks/step/gate.c); None with several ranks, Triton, or no compiled library."""
        if self.whole is None or not self.repeated:
            return None
        return whole_native_call(self.backend, logits, request, self.vocab_size, out)

    @property
    def bytes_sent(self) -> int:
        return self.exchange1.bytes_sent + self.exchange2.bytes_sent

    def __call__(
        self, logits: torch.Tensor, request: RowRequest, out: torch.Tensor,
        entropy_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The packed payload of the flagged rows into ``out``; with ``entropy_out`` (FP32
        [rows]) also their entropy (other rows of it untouched)."""
        if logits.shape != (self.rows, self.width):
            raise ValueError(f"logits: expected {(self.rows, self.width)}, got {logits.shape}")
        flags = request.requested
        if self.whole is not None:
            if entropy_out is not None:
                whole_flagged(logits, flags, self.local_valid, entropy_out)
            return self.whole(logits, request, self.vocab_size, out)
        steps = self.steps
        steps.shard_stats(logits, request, self.local_valid, self.exchange1.send)
        if entropy_out is not None:
            write_entropy_word(logits, flags, self.local_valid, self.exchange1.send)
        e1_all = self.exchange1.gather()
        if entropy_out is not None:
            combine_flagged(e1_all, flags, entropy_out)
        steps.shard_candidates(
            logits, request, e1_all if self.unit_e1 is None else self.unit_e1,
            self.vocab_start, self.local_valid, self.lse, self.exchange2.send,
        )
        e2_all = self.exchange2.gather()
        steps.final_merge(e2_all, self.lse, request, self.shard_starts, out)
        return out


def unit_statistics(world: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """Exchange-1 words [world, rows, 3] whose global normalization is exactly 0: rank 0's
    max 0 and mass 1, every other rank's max -inf and mass 0 (lse = 0 + log 1)."""
    words = torch.zeros(world, rows, EXCHANGE1_WORDS, dtype=torch.float32, device=device)
    words[1:, :, 0] = float("-inf")
    words[0, :, 1] = 1.0
    return words.view(torch.int32)


def prepared_reduction(
    group: object,
    rows: int,
    width: int,
    vocab_start: int,
    vocab_size: int,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
) -> PreparedShardedReduction:
    """Cached PreparedShardedReduction for this configuration.

    The cached object holds a strong reference to the group, so id(group) cannot be reused
    while its entry lives. Eviction is FIFO over the same call sequence on every rank, so a
    miss (and its collective construction) happens on all ranks together.
    """
    key = (id(group), rows, width, vocab_start, vocab_size, backend, str(device), dtype)
    hit = _cache.get(key)
    if hit is not None and hit.group is group:
        return hit
    local_valid = max(0, min(vocab_size - vocab_start, width))
    prepared = PreparedShardedReduction(
        group, rows, width, vocab_start, local_valid, vocab_size, backend, device
    )
    _cache[key] = prepared
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return prepared
