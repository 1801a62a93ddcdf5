"""The compiled forward's padding and variants (ranks/step/forward_graph.py), checked on the
traced function itself (no Inductor: the compiled runs are test_compiled_reduction.py and the
TP2 test): padded token buckets with the key gather over a dynamic length give the eager
planned forward's hidden rows and cache, padding writes only the spare slot, the start-up
runs of every bucket leave the serving slots untouched, and the host choice sends decode to
the graph and long prefill batches to the eager forward."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.model.llama import ShardedCausalLM
from helios_logprobs.ranks.step.forward_graph import ForwardGraph, token_buckets
from tests.checkpoints import write_qwen2
from tests.serving_engines import SCALAR_INDUCTOR

pytestmark = pytest.mark.slow

CAPACITY, LENGTH = 4, 96


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_the_bucket_ladder_doubles_from_one_through_decode_to_the_budget():
    assert token_buckets(12, 24) == (1, 2, 4, 8, 16, 24)
    assert token_buckets(16, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert token_buckets(1, 1) == (1, 2)
    assert token_buckets(40, 24) == (1, 2, 4, 8, 16, 32, 40)


def pair(model_dir):
    """(a model with the spare slot behind an uncompiled ForwardGraph, the eager model)."""
    padded = ShardedCausalLM.load(model_dir)
    padded.allocate_cache(CAPACITY, LENGTH, spare_slots=1)
    graph = ForwardGraph(padded, CAPACITY, LENGTH, decode_rows=4, token_budget=24,
                         device=torch.device("cpu"), compile=False)
    eager = ShardedCausalLM.load(model_dir)
    eager.allocate_cache(CAPACITY, LENGTH)
    return graph, eager


def test_start_up_runs_every_bucket_on_the_spare_slot_only(qwen2):
    graph, _ = pair(qwen2)
    cache = graph.model.cache
    assert graph.buckets == (1, 2, 4, 8, 16, 24)
    for keys, values in zip(cache.keys, cache.values, strict=True):
        assert keys.shape[0] == CAPACITY + 1
        assert not keys[:CAPACITY].any() and not values[:CAPACITY].any()
        assert keys[CAPACITY, 0].any() and not keys[CAPACITY, 1:].any()


def batch(*items):
    """items: (slot, start, tokens) -> the step's (ids, positions, slots) tensors, host."""
    ids, positions, slots = [], [], []
    for slot, start, tokens in items:
        ids += tokens
        positions += range(start, start + len(tokens))
        slots += [slot] * len(tokens)
    host = (ids, positions, slots, list(range(len(ids))))
    return (torch.tensor(ids), torch.tensor(positions), torch.tensor(slots)), host


def test_padded_buckets_give_the_planned_forward_rows_and_cache(qwen2):
    graph, eager = pair(qwen2)
    steps = [
        batch((0, 0, [5, 6, 7, 8, 9, 10]), (1, 0, [3, 4, 5])),  # two prefill chunks
        batch((0, 6, [11]), (1, 3, [12, 13, 14]), (2, 0, [7, 8])),  # decode, round, prefill
        batch((2, 2, [40])),  # one token: bucket 1
        batch((0, 7, [1]), (1, 6, [2]), (2, 3, [3]), (3, 0, [4, 5, 6])),
    ]
    chosen = []
    for tensors, host in steps:
        variant = graph.select(host)
        chosen.append((variant.tokens, variant.key_length))
        graph.model.check_batch(*tensors, torch.tensor(host[3]), host)
        graph.load(variant, *tensors)
        n = len(host[0])
        hidden = variant.run()[:n]
        expected = eager.forward_hidden(*tensors, torch.tensor(host[3]), host)
        torch.testing.assert_close(hidden, expected, rtol=0, atol=2e-5)
    assert chosen == [(16, 6), (8, 7), (1, 3), (8, 8)]
    for padded, keys in zip(graph.model.cache.keys, eager.cache.keys, strict=True):
        torch.testing.assert_close(padded[:CAPACITY], keys, rtol=0, atol=2e-5)
        assert not padded[CAPACITY, 1:].any()  # padding: the spare slot's position 0 only


def test_long_prefill_batches_stay_eager(qwen2):
    graph, _ = pair(qwen2)
    assert graph.gather_limit == 4 * LENGTH
    _, decode = batch((0, 90, [1]), (1, 95, [2]), (2, 10, [3]), (3, 0, [4]))
    assert graph.select(decode).tokens == 4  # decode at full length: always compiled
    _, short = batch((0, 0, list(range(16))))
    assert graph.select(short).tokens == 16  # 16 x 16 keys <= 4 x 96
    _, long = batch((0, 0, list(range(17))))
    assert graph.select(long) is None  # 24 x 17 keys: the eager planned forward
    _, late = batch((0, 40, list(range(8))))
    assert graph.select(late).tokens == 8  # 8 x 48 keys: at the limit
    _, later = batch((0, 41, list(range(8))))
    assert graph.select(later) is None  # 8 x 49 keys
    _, empty = batch()
    assert graph.select(empty) is None


def test_one_compiled_graph_serves_steps_of_any_budget(qwen2):
    """The compiled graphs' sizes carry one bound whatever the step's budget: a second step
    with a larger ladder runs every bucket on the first one's two graphs (the single token's
    and the batch's; a per-step bound was a guard that Inductor's cache handed to later
    processes)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    graphs = []
    for budget in (24, 256):
        model = ShardedCausalLM.load(qwen2)
        model.allocate_cache(CAPACITY, LENGTH, spare_slots=1)
        with torch._dynamo.config.patch(error_on_recompile=len(graphs) > 0), \
                torch._inductor.config.patch(SCALAR_INDUCTOR):
            graph = ForwardGraph(model, CAPACITY, LENGTH, decode_rows=4, token_budget=budget,
                                 device=torch.device("cpu"))
            variant = graph.variants[budget]
            variant.key_length = LENGTH
            variant.run()
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [2, 2]
