"""The sharded Triton reduction's launch groups as torch.library triton_ops
(kernels/triton/ops.py), under the Triton interpreter: their schemas declare what each group
writes; a TP1 reduction through the three ops, called eagerly and traced by
torch.compile(fullgraph=True) (no graph break; the eager backend: the interpreter cannot run
Inductor's kernels), writes the payload the exact expectation and the float64 reference
give; their fake implementations launch nothing. tests/gpu/test_triton_gpu.py runs the same
launches compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import helios_logprobs.kernels.triton.ops  # noqa: F401  (registers helios::triton_*)
from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS
from helios_logprobs.kernels.triton.sharded import PreparedShardedReduction
from tests.reduction_cases import (
    assert_matches_reference,
    exact_expected,
    first_difference,
    pack,
    random_case,
    sentinel_out,
)

pytestmark = pytest.mark.triton_cpu

OPS = torch.ops.helios


def written(op) -> set[str]:
    return {a.name for a in op.default._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write}


def test_each_op_declares_what_it_writes():
    assert written(OPS.triton_shard_stats) == {"tile_max", "tile_mass", "e1_out"}
    assert written(OPS.triton_shard_candidates) == {"cand", "lse_out", "e2_out"}
    assert written(OPS.triton_final_merge) == {"out"}


def reduce_tp1(prepared, vocab, logits, chosen, ids, counts, requested, e1, lse, e2, starts,
               out):
    """Launches 1-6 of one rank holding the whole vocabulary (the exchanges: a stack)."""
    p = prepared
    OPS.triton_shard_stats(logits, requested, vocab, p.block_size, p.block_tiles, p.tile_max,
                           p.tile_mass, e1)
    OPS.triton_shard_candidates(logits, chosen, ids, counts, requested, e1.unsqueeze(0), 0,
                                vocab, p.block_size, p.merge_block, p.select, p.cand, lse, e2)
    OPS.triton_final_merge(e2.unsqueeze(0), lse, chosen, ids, counts, requested, starts, 20,
                           p.select, out)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fullgraph"])
def test_a_reduction_through_the_ops_equals_the_expectation(compiled):
    rows, vocab = 6, 300
    logits, chosen, token_ids, requested = random_case(rows, vocab, vocab, torch.float32, 7,
                                                       garbage=False)
    ids, counts = pack(token_ids, rows)
    prepared = PreparedShardedReduction(rows, vocab, torch.float32, torch.device("cpu"),
                                        block_size=64, merge_block=64)
    e1 = torch.full((rows, EXCHANGE1_WORDS), 77, dtype=torch.int32)
    e2 = torch.full((rows, EXCHANGE2_WORDS), 77, dtype=torch.int32)
    lse = torch.zeros(rows)
    starts = torch.tensor([0, vocab])
    out = sentinel_out(rows)
    fn = reduce_tp1
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(reduce_tp1, fullgraph=True, backend="eager")
    fn(prepared, vocab, logits, chosen, ids, counts, requested, e1, lse, e2, starts, out)
    expected = exact_expected(logits, chosen, token_ids, requested, 20, vocab, lse,
                              sentinel_out(rows))
    assert torch.equal(out, expected), first_difference(out, expected)
    assert_matches_reference(out, logits, chosen, token_ids, requested, 20, vocab,
                             sentinel_out(rows))
    assert e1[requested == 0].eq(77).all()  # (zero flags: those rows never written)


def test_the_fake_implementations_launch_nothing():
    with FakeTensorMode():
        logits = torch.empty(4, 300)
        flags = torch.ones(4, dtype=torch.int32)
        tiles = torch.empty(4, 5)
        e1 = torch.empty(4, EXCHANGE1_WORDS, dtype=torch.int32)
        assert OPS.triton_shard_stats(logits, flags, 300, 64, 8, tiles, tiles.clone(),
                                      e1) is None
