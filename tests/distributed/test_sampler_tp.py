"""The sharded sampler at TP2 and TP4 over real gloo groups equals TP1 on the full row."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.collectives.groups import group_rank, group_size, world_group
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler
from tests import sampler_oracle as oracle
from tests.distributed.harness import run_ranks

VOCAB = 301
STEPS = 6
TIMEOUT_S = 120.0
PAD_VALUE = 1e30
ROWS = 18
NEG_INF = float("-inf")

pytestmark = pytest.mark.slow


def shard(world: int, rank: int) -> tuple[int, int, int]:
    width = -(-VOCAB // world)
    start = rank * width
    return start, width, min(width, VOCAB - start)


def scenario(step: int) -> tuple[torch.Tensor, list[RowSampling], list[list[int]], list[list[int]]]:
    """Mixed rows: greedy with ties across shards, temperature, top-k (small, tied, radix),
    top-p (tied), min-p, combinations, penalties, logit_bias and a grammar mask. Row 16 is
    greedy where vLLM's order (logit_bias, then the repetition penalty) changes the token;
    row 17 has min-p cut the tail that radix top-k and top-p then see."""
    gen = torch.Generator().manual_seed(100 + step)
    params = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(seed=2**64 - 5),
        dict(top_k=5),
        dict(top_k=3, temperature=2.0),
        dict(top_k=280),
        dict(top_p=0.9),
        dict(top_p=0.5, temperature=3.0),
        dict(min_p=0.1, temperature=1.5),
        dict(top_k=50, top_p=0.8, min_p=0.05, temperature=0.7),
        dict(
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logit_bias={300: 3.0, 0: -2.0, 151: 1.0},
        ),
        dict(allowed_token_ids=(3, 150, 151, 225, 300), top_p=0.9, temperature=4.0),
        dict(seed=-(2**40), top_k=290, top_p=0.3),
        dict(temperature=0.05, min_p=0.5),
        dict(temperature=0.0, repetition_penalty=2.0, logit_bias={208: 4.0}),
        dict(top_k=280, top_p=0.6, min_p=0.03, temperature=1.5),
    ]
    rows = [
        RowSampling(**({"seed": 7 * i + 1, "position": step} | p)) for i, p in enumerate(params)
    ]
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
    logits[1, [151, 226, 290]] = 50.0
    logits[2, [5, 150, 151]] = 50.0
    logits[6, [10, 160, 230, 299]] = 12.0
    logits[9, [70, 151, 152, 300]] = 6.0
    logits[12] = logits[12].round()
    logits[16, [208, 260]] = torch.tensor([20.0, 13.0])  # 208 is in the prompt: (20 + 4) / 2
    prompt = [[(13 * i + 7 * j) % VOCAB for j in range(6)] for i in range(len(rows))]
    output = [[(29 * i + 151 * j) % VOCAB for j in range(step + 3)] for i in range(len(rows))]
    return logits, rows, prompt, output


def plain_greedy_logits() -> torch.Tensor:
    """Rows that every sampler path takes greedily without processors (the compiled argmax
    where it is built): the maximum on three shards, -0.0 before +0.0, only -inf, NaN lanes
    beside the maximum, only NaN, +inf on two shards."""
    x = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    x[1, [290, 151, 226]] = 50.0
    x[2] = NEG_INF
    x[2, [200, 160]] = torch.tensor([0.0, -0.0])
    x[3] = NEG_INF
    x[4, [3, 155]] = float("nan")
    x[4, 299] = 60.0
    x[5] = float("nan")
    x[6, [250, 140]] = float("inf")
    return x


EDGE_ALLOWED = (3, 150, 151, 225, 300)
"""Allowed ids on every shard at TP4 (width 76), seen in the prompt or the output or not."""


def edge_scenario() -> tuple[torch.Tensor, list[RowSampling], list[list[int]], list[list[int]]]:
    """Penalties at float32's edges (they round to 0 or inf there) beside a grammar mask and
    every filter: the rows saturate rather than turn NaN or -inf (tests/unit/ranks/
    test_sampler_extremes.py), the same way on every shard."""
    penalties = [5e-324, 1e-45, 1e300, 1.7e308]
    params = [dict(repetition_penalty=p, temperature=t, allowed_token_ids=EDGE_ALLOWED)
              for p in penalties for t in (0.0, 1.0, 1e-5)]
    params += [dict(repetition_penalty=5e-324, top_k=2, top_p=0.4, min_p=0.1),
               dict(repetition_penalty=1e300, frequency_penalty=2.0, top_p=5e-324),
               dict(repetition_penalty=1e300, logit_bias={150: 100.0}, min_p=0.9,
                    allowed_token_ids=EDGE_ALLOWED)]
    rows = [RowSampling(**({"seed": 11 * i + 3, "position": 4} | p))
            for i, p in enumerate(params)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    logits[:, 151] = -2.0  # seen and negative: x inf overflows to -inf in float32
    logits[:, 225] = 0.0  # seen and zero: 0 x inf is NaN in float32
    prompt = [[151, 225, 7, 3] for _ in rows]
    output = [[300, 151, 8] for _ in rows]
    return logits, rows, prompt, output


def run_steps(sampler: ShardedSampler, start: int, width: int, valid: int) -> dict:
    ids, processed, intact = [], [], True
    for step in range(STEPS):
        full, rows, prompt, output = scenario(step)
        local = torch.full((len(rows), width), PAD_VALUE)
        local[:, :valid] = full[:, start : start + valid]
        before = local.clone()
        ids.append(sampler.sample(local, rows, prompt, output))
        processed.append(sampler.processed(local, rows, prompt, output).clone())
        intact = intact and torch.equal(local, before)
    cheap = [RowSampling(seed=5, position=0, temperature=t) for t in (0.0, 1.0, 0.5)]
    sent_before, filter_calls = sampler.pick_exchange.bytes_sent, sampler.filter_exchange.calls
    sampler.sample(torch.zeros(3, width), cheap, [[]] * 3, [[]] * 3)
    cheap_bytes = sampler.pick_exchange.bytes_sent - sent_before
    plain = torch.full((7, width), PAD_VALUE)
    plain[:, :valid] = plain_greedy_logits()[:, start : start + valid]
    greedy = [RowSampling(seed=i, position=0, temperature=0.0) for i in range(7)]
    result = {
        "greedy": sampler.sample(plain, greedy, [[]] * 7, [[]] * 7),
        "ids": ids,
        "processed": processed,
        "intact": intact,
        "cheap_bytes": cheap_bytes,
        "cheap_filter_calls": sampler.filter_exchange.calls - filter_calls,
    }
    full, rows, prompt, output = edge_scenario()
    edge = torch.full((len(rows), width), PAD_VALUE)
    edge[:, :valid] = full[:, start : start + valid]
    result["edge"] = sampler.sample(edge, rows, prompt, output)
    return result


def _rank_main() -> dict:
    group = world_group()
    start, width, valid = shard(group_size(group), group_rank(group))
    sampler = ShardedSampler(group, start, valid, width, VOCAB, max_rows=ROWS)
    return run_steps(sampler, start, width, valid)


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_steps(ShardedSampler(None, 0, VOCAB, VOCAB, VOCAB, max_rows=ROWS), 0, VOCAB, VOCAB)


def test_tp1_scenario_is_not_trivial(tp1: dict):
    first = tp1["ids"][0].tolist()
    assert first[1] == 151 and first[2] == 5
    assert first[6] in (10, 160, 230, 299)
    assert first[16] == 260
    kept = (tp1["processed"][0] > float("-inf")).sum(1).tolist()
    assert kept[6] == 4 and kept[7] == 280 and kept[0] == VOCAB
    assert len({tuple(ids.tolist()) for ids in tp1["ids"]}) == STEPS


def test_edge_penalties_pick_allowed_ids(tp1: dict):
    _, rows, _, _ = edge_scenario()
    picked = tp1["edge"].tolist()
    assert all(0 <= t < VOCAB for t in picked)
    for r, t in zip(rows, picked, strict=True):
        assert r.allowed_token_ids is None or t in r.allowed_token_ids, (r, t)
    assert picked[-1] == 150  # the biased, allowed lane under min-p 0.9


def test_plain_greedy_rows_take_the_argmax_with_nan_as_minus_inf(tp1: dict):
    x = plain_greedy_logits()
    want = torch.argmax(torch.where(x.isnan(), NEG_INF, x), dim=1)
    assert tp1["greedy"].tolist() == want.tolist()
    assert want.tolist()[1:] == [151, 160, 0, 299, 0, 140]


def test_tp1_matches_the_oracle(tp1: dict):
    for step in range(STEPS):
        full, rows, prompt, output = scenario(step)
        for i, r in enumerate(rows):
            expected = oracle.final(full[i], r, prompt[i], output[i])
            assert torch.equal(tp1["processed"][step][i], expected), (step, i)
            assert int(tp1["ids"][step][i]) == oracle.sample(full[i], r, prompt[i], output[i])


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_sampler_matches_tp1(world: int, tp1: dict):
    results = run_ranks(_rank_main, world, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        start, _, valid = shard(world, rank)
        assert result["intact"], f"rank {rank} modified its logits"
        for step in range(STEPS):
            assert result["ids"][step].tolist() == tp1["ids"][step].tolist(), (rank, step)
            expected = tp1["processed"][step][:, start : start + valid]
            assert torch.equal(result["processed"][step], expected), (rank, step)
        assert result["greedy"].tolist() == tp1["greedy"].tolist(), rank
        assert result["edge"].tolist() == tp1["edge"].tolist(), rank
        assert result["cheap_filter_calls"] == 0
        assert result["cheap_bytes"] == 3 * 3 * 4
