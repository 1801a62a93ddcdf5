"""The Triton reductions compiled for and run on a CUDA GPU, against the reference, at
serving shapes (up to 151,936 vocabulary lanes and 256 rows); the prepared reduction
allocates nothing after its first call and survives CUDA-graph capture.

Skipped without CUDA (scripts/device-check.sh runs it on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import gpu_marks

pytestmark = gpu_marks()

from helios_logprobs.kernels.triton.backend import PreparedReduction, prepared_reduction  # noqa: E402
from helios_logprobs.kernels.triton.common import SELECT_EXTRACT, SELECT_TOPK  # noqa: E402
from helios_logprobs.kernels.triton.sharded import PreparedShardedReduction  # noqa: E402
from tests.reduction_cases import (  # noqa: E402
    assert_matches_reference,
    exact_expected,
    first_difference,
    pack,
    random_case,
    run_prepared,
    sentinel_out,
    simulate_world,
)

QWEN_VOCAB = 151_936
CUDA = torch.device("cuda")


def check(prepared, logits, chosen, token_ids, requested, k, vocab):
    out, base, lse = run_prepared(prepared, logits, chosen, token_ids, requested, k, vocab)
    expected = exact_expected(logits, chosen, token_ids, requested, k, vocab, lse, base)
    assert torch.equal(out, expected), first_difference(out, expected)
    assert_matches_reference(out, logits, chosen, token_ids, requested, k, vocab, base)
    return out


@pytest.mark.parametrize(
    ("rows", "vocab", "width", "dtype"),
    [
        (256, QWEN_VOCAB, QWEN_VOCAB, torch.bfloat16),
        (37, 32_000, 32_064, torch.float32),
        (64, 128_256, 128_256, torch.float16),
        (1, 7, 7, torch.float32),
    ],
)
def test_single_rank_serving_shapes(rows, vocab, width, dtype):
    logits, chosen, token_ids, requested = random_case(rows, vocab, width, dtype, rows + vocab)
    prepared = prepared_reduction(rows, width, dtype, CUDA)
    check(prepared, logits, chosen, token_ids, requested, 20, vocab)


@pytest.mark.parametrize("select", [SELECT_TOPK, SELECT_EXTRACT])
def test_selection_networks_agree(select):
    logits, chosen, token_ids, requested = random_case(48, 50_000, 50_000, torch.bfloat16, 9)
    logits[3, :] = 1.0  # one row of total ties
    prepared = PreparedReduction(48, 50_000, torch.bfloat16, CUDA, select=select)
    out = check(prepared, logits, chosen, token_ids, requested, 20, 50_000)
    if int(requested[3]) and not (token_ids and token_ids[3]):
        assert out[3, 2:42:2].tolist() == list(range(20))


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_steps_on_gpu(world):
    vocab = QWEN_VOCAB
    width = -(-vocab // world)
    starts = [min(r * width, vocab) for r in range(world)] + [vocab]
    logits, chosen, token_ids, requested = random_case(64, vocab, vocab, torch.bfloat16, world,
                                                       garbage=False)
    prepared = PreparedShardedReduction(64, width, torch.bfloat16, CUDA)
    outs, lses, _, _ = simulate_world(logits, starts, width, chosen, token_ids, requested, 20,
                                      prepared=prepared)
    base = sentinel_out(64)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    expected = exact_expected(logits, chosen, token_ids, requested, 20, vocab, lses[0], base)
    assert torch.equal(outs[0], expected), first_difference(outs[0], expected)
    assert_matches_reference(outs[0], logits, chosen, token_ids, requested, 20, vocab, base)


def test_prepared_call_allocates_nothing_and_captures():
    rows, vocab = 256, QWEN_VOCAB
    logits, chosen, token_ids, requested = random_case(rows, vocab, vocab, torch.bfloat16, 5)
    ids, counts = pack(token_ids, rows)
    logits, chosen, ids, counts, requested = (
        t.to(CUDA) for t in (logits, chosen, ids, counts, requested)
    )
    prepared = PreparedReduction(rows, vocab, torch.bfloat16, CUDA)
    out = sentinel_out(rows).to(CUDA)
    prepared(logits, chosen, ids, counts, requested, 20, vocab, out)
    torch.cuda.synchronize()
    first = out.clone()
    before = torch.cuda.memory_allocated()
    prepared(logits, chosen, ids, counts, requested, 20, vocab, out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(out, first)

    # The launches capture into a CUDA graph and replay to the same payload.
    captured = sentinel_out(rows).to(CUDA)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prepared(logits, chosen, ids, counts, requested, 20, vocab, captured)  # warm, eager
    torch.cuda.current_stream().wait_stream(stream)
    captured.copy_(sentinel_out(rows).to(CUDA))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared(logits, chosen, ids, counts, requested, 20, vocab, captured)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first)
