"""The Triton sharded reduction over real gloo process groups (TP2 and TP4), through the
public entry point kernels.reduce_logprobs_sharded(..., backend="triton"): every rank writes
the same packed payload, equal to the reference on the full row (FP32 tolerance, ids exact
where values differ by more than it), and rows with a zero flag stay untouched.

The Triton kernels run through the interpreter in each rank (the harness starts ranks with
TRITON_INTERPRET=1 and no visible GPU, on any host: tests/devices.py).
"""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.collectives.groups import group_rank, group_size, world_group
from helios_logprobs.kernels.api import reduce_logprobs_sharded
from tests.distributed.harness import run_ranks
from tests.reduction_cases import (
    assert_matches_reference,
    random_case,
    sentinel_out,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0
NAN = float("nan")


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor, list[list[int]] | None,
                          torch.Tensor, int, int]]:
    """(name, full logits, chosen, token_ids, requested, k, vocab) — identical on every rank
    (seeded), including a vocabulary that TP does not divide."""
    out = []
    logits, chosen, token_ids, requested = random_case(11, 423, 423, torch.float32, 70,
                                                       garbage=False)
    out.append(("fp32-423", logits, chosen, token_ids, requested, 20, 423))
    logits, chosen, token_ids, requested = random_case(3, 1001, 1001, torch.bfloat16, 71,
                                                       garbage=False)
    out.append(("bf16-1001", logits, chosen, token_ids, requested, 5, 1001))
    special = torch.randn(5, 30, generator=torch.Generator().manual_seed(72))
    special[0, 29] = NAN  # NaN on the last shard only
    special[1, :] = float("-inf")
    special[2, :] = 1.5  # every value tied: ids 0..19, across shards
    chosen = torch.tensor([29, 0, 17, 3, 4], dtype=torch.int32)
    requested = torch.tensor([1, 1, 1, 1, 0], dtype=torch.int32)
    token_ids = [[], [], [], [29, 0, 15], []]
    out.append(("special-30", special, chosen, token_ids, requested, 20, 30))
    return out


def rank_main() -> list[torch.Tensor]:
    """Runs on every rank: shard each case's row, reduce with backend="triton"."""
    group = world_group()
    world, rank = group_size(group), group_rank(group)
    results = []
    for _name, logits, chosen, token_ids, requested, k, vocab in cases():
        width = -(-vocab // world)
        start = rank * width
        local = torch.full((logits.shape[0], width), NAN, dtype=logits.dtype)  # padding
        n = max(0, min(width, vocab - start))
        local[:, :n] = logits[:, start : start + n]
        out = sentinel_out(logits.shape[0])
        reduce_logprobs_sharded(
            local, chosen, vocab_start=start, vocab_size=vocab, group=group, k=k,
            token_ids=token_ids, requested=requested, out=out, backend="triton",
        )
        results.append(out)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_triton_sharded_over_gloo(world: int):
    per_rank = run_ranks(rank_main, world, timeout_s=TIMEOUT_S)
    for case_index, (name, logits, chosen, token_ids, requested, k, vocab) in enumerate(cases()):
        got = per_rank[0][case_index]
        for rank in range(1, world):
            assert torch.equal(per_rank[rank][case_index], got), f"{name}: rank {rank} differs"
        assert_matches_reference(got, logits, chosen, token_ids, requested, k, vocab,
                                 sentinel_out(logits.shape[0]))
        if name == "special-30":
            nan_bits = int(torch.tensor([NAN]).view(torch.int32)[0])
            assert int(got[0, 1]) == nan_bits and int(got[1, 1]) == nan_bits
            assert got[2, 2:42:2].tolist() == list(range(20))
            assert got[3, 2:8:2].tolist() == [29, 0, 15] and got[3, 8:].eq(-1).all()
