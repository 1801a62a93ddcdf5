"""No vocabulary-sized row is gathered between ranks: every collective that actually runs, at
TP2 and TP4 on real gloo groups, recorded where it reaches the c10d dispatcher
(tests/distributed/collective_log.py), not as the code under test counts it.

- The sharded reduction (kernels.api.reduce_logprobs_sharded -> kernels/sharded.py): each call
  is exactly two all-gathers, int32 [rows, 2] then int32 [rows, 129] per rank, into
  [world * rows, words]; its first call adds only the set-up exchange of shard bounds.
- Whole engine steps (ranks/step.py RankStep.run with a model): the model's all-reduces of
  [tokens, hidden] FP32, the sampler's fixed-width int32 exchanges (256-word filters, 3-word
  pick) and the reduction's two exchanges when a lane requests logprobs; nothing else.

The vocabulary (5003) is far wider than the hidden size (64), the intermediate size (128) and
every exchange width (2, 3, 129, 256), and its TP4 shard (1251 lanes) too, so a tensor with a
vocabulary-sized dimension cannot pass for one of the allowed ones. One launch per world size
runs both parts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS
from helios_logprobs.ranks.sampler.filters import FILTER_WORDS, PICK_WORDS
from tests.checkpoints import write_llama
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

VOCAB = 5003
HIDDEN = 64
LAYERS = 2
CAPACITY = 4
ALL_GATHER_FLAT = "_allgather_base_"
"""The c10d operator of all_gather_into_tensor / all_gather_single (one flat output)."""


# ----------------------------------------------------------------------------- ranks
def _reduction_calls(world: int, rank: int) -> list[dict]:
    """Two configurations (3 rows with selected ids and a flag off; 1 row), two calls each."""
    from helios_logprobs.collectives.groups import world_group
    from helios_logprobs.kernels.api import reduce_logprobs_sharded
    from tests.distributed.collective_log import record_collectives

    width = -(-VOCAB // world)
    start = rank * width
    calls = []
    for rows, seed in ((3, 1), (1, 2)):
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(rows, width * world, generator=g)
        local = full[:, start : start + width].contiguous()
        chosen = torch.randint(0, VOCAB, (rows,), generator=g)
        token_ids = [[7, VOCAB - 1, 2600]] + [[] for _ in range(rows - 1)]
        requested = torch.ones(rows, dtype=torch.int32)
        requested[rows - 1] = 0 if rows > 1 else 1
        for call in range(2):
            with record_collectives() as log:
                reduce_logprobs_sharded(
                    local, chosen, vocab_start=start, vocab_size=VOCAB, group=world_group(),
                    token_ids=token_ids, requested=requested,
                )
            calls.append({"rows": rows, "call": call, "log": list(log)})
    return calls


def _spec(ordinal: int, logprobs: bool = False, ids: tuple[int, ...] = (), **sampling):
    from helios_logprobs.ranks.plan import RequestSpec
    from helios_logprobs.ranks.sampler.params import RowSampling

    return RequestSpec(ordinal=ordinal, max_tokens=16,
                       sampling=RowSampling(seed=100 + ordinal, position=0, **sampling),
                       wants_logprobs=logprobs, logprob_token_ids=ids)


def _steps(step, world: int) -> list[dict]:
    """Four submissions: prefill (one chunk not sampling), decode with every sampler path,
    a step in which no lane requests logprobs, and one that is a plain decode."""
    from helios_logprobs.ranks.plan import SlotWork, StepPlan
    from tests.distributed.collective_log import record_collectives

    shard = -(-VOCAB // world)
    owned_by_each_rank = tuple(min(r * shard + 11, VOCAB - 1) for r in range(world))
    specs = {
        0: _spec(1, logprobs=True, temperature=0.0),
        1: _spec(2, logprobs=True, ids=owned_by_each_rank, temperature=0.9, top_k=40,
                 top_p=0.9, min_p=0.02),
        2: _spec(3, temperature=1.0, top_k=600, top_p=0.8, repetition_penalty=1.2),
        3: _spec(4, logprobs=True, temperature=0.7),
    }
    prompts = {0: (5, 6, 7, 8, 9, 10), 1: (3, 9, 27, 81, 243), 2: (40, 41, 42), 3: (1, 2, 3, 4)}

    def decode(slot: int) -> SlotWork:
        state = step.slots[slot]
        return SlotWork(slot, 1, (state.output[-1],), state.length, True)

    out = []

    def run(plan: StepPlan, label: str) -> None:
        with record_collectives() as log:
            step.run(plan)
        tokens = sum(len(w.tokens) for w in plan.work)
        logprob_lanes = sum(1 for w in plan.work
                            if w.samples and step.slots[w.slot].spec.wants_logprobs)
        out.append({"label": label, "tokens": tokens, "sampled": sum(w.samples for w in plan.work),
                    "logprob_lanes": logprob_lanes, "log": list(log)})

    run(StepPlan(0, tuple(
        [SlotWork(s, 1, prompts[s], 0, True, specs[s]) for s in (0, 1, 2)]
        + [SlotWork(3, 1, prompts[3][:2], 0, False, specs[3])]
    )), "prefill")
    run(StepPlan(1, (decode(0), decode(1), decode(2),
                     SlotWork(3, 1, prompts[3][2:], 2, True))), "decode-all")
    run(StepPlan(2, (decode(2),)), "no-logprob-lane")
    run(StepPlan(3, (decode(0), decode(3))), "decode-two")
    return out


def rank_main(model_dir: str) -> dict:
    from helios_logprobs.collectives.groups import group_rank, group_size, world_group
    from helios_logprobs.ranks.model import ShardedCausalLM
    from helios_logprobs.ranks.step import RankStep, StepConfig
    from tests.distributed.collective_log import record_collectives

    group = world_group()
    world, rank = group_size(group), group_rank(group)
    result = {"reduction": _reduction_calls(world, rank)}
    with record_collectives() as setup:
        model = ShardedCausalLM.load(model_dir, group)
        step = RankStep(model, group, StepConfig(capacity=CAPACITY, max_seq_len=64))
    result["local_width"] = model.local_width
    result["setup"] = list(setup)
    result["steps"] = _steps(step, world)
    result["outputs"] = {slot: list(state.output) for slot, state in step.slots.items()}
    return result


# ----------------------------------------------------------------------------- checks
def is_exchange(c, rows: int, words: int, world: int) -> bool:
    """One flat int32 all-gather of [rows, words] per rank into [world * rows, words]."""
    return (c.op == ALL_GATHER_FLAT and c.dtypes == {torch.int32}
            and sorted(c.shapes()) == sorted([(world * rows, words), (rows, words)]))


def describe(log) -> str:
    return "\n".join(f"  {c.api or '(group method)'} -> c10d::{c.op} "
                     f"{[(s, str(d)) for s, d in c.tensors]}" for c in log)


def check_no_vocabulary_dimension(log, limit: int, where: str) -> None:
    for c in log:
        assert all(d < limit for d in c.dims), (
            f"{where}: a collective moved a tensor with a dimension >= {limit} "
            f"(the narrowest vocabulary shard):\n{describe([c])}"
        )


def check_reduction(world: int, calls: list[dict]) -> None:
    for entry in calls:
        rows, log = entry["rows"], entry["log"]
        where = f"TP{world} reduction, {rows} rows, call {entry['call']}"
        if entry["call"] == 0:
            # Set-up, once per configuration: the shard bounds, through all_gather_object.
            setup = [c for c in log if c.api == "all_gather_object"]
            assert setup and all(c.op == "allgather_" for c in setup), where + describe(log)
            assert all(max(c.dims, default=0) < 1024 for c in setup), where + describe(setup)
            log = [c for c in log if c.api != "all_gather_object"]
        assert len(log) == 2, f"{where}: expected exactly two all-gathers, got\n{describe(log)}"
        assert is_exchange(log[0], rows, EXCHANGE1_WORDS, world), where + describe(log)
        assert is_exchange(log[1], rows, EXCHANGE2_WORDS, world), where + describe(log)


def check_steps(world: int, result: dict) -> None:
    limit = result["local_width"]
    assert limit >= VOCAB // world > 4 * FILTER_WORDS  # the assertion discriminates
    # Set-up: shard bounds (all_gather_object, small) and possibly a warm-up reduction.
    setup = result["setup"]
    check_no_vocabulary_dimension(setup, limit, f"TP{world} set-up")
    for c in setup:
        assert (c.api == "all_gather_object" and max(c.dims) < 1024) or any(
            is_exchange(c, CAPACITY, w, world) for w in (EXCHANGE1_WORDS, EXCHANGE2_WORDS)
        ), f"TP{world} set-up:\n{describe([c])}"
    for entry in result["steps"]:
        log, where = entry["log"], f"TP{world} step {entry['label']}"
        check_no_vocabulary_dimension(log, limit, where)
        reduces = [c for c in log if c.op == "allreduce_"]
        gathers = [c for c in log if c.op == ALL_GATHER_FLAT]
        assert len(reduces) + len(gathers) == len(log), f"{where}: unexpected\n{describe(log)}"
        # The model: vocabulary-parallel embedding, then o_proj and down_proj of each layer.
        assert len(reduces) == 1 + 2 * LAYERS, where + describe(reduces)
        for c in reduces:
            assert c.api == "all_reduce" and c.tensors == (((entry["tokens"], HIDDEN),
                                                             torch.float32),), where + describe([c])
        # The sampler's fixed-width exchanges, then the reduction's two.
        reduction = gathers[-2:] if entry["logprob_lanes"] else []
        sampler = gathers[: len(gathers) - len(reduction)]
        if entry["logprob_lanes"]:
            assert is_exchange(reduction[0], CAPACITY, EXCHANGE1_WORDS, world), where
            assert is_exchange(reduction[1], CAPACITY, EXCHANGE2_WORDS, world), where
        assert sampler and is_exchange(sampler[-1], entry["sampled"], PICK_WORDS, world), (
            where + describe(sampler))
        for c in sampler[:-1]:
            assert any(is_exchange(c, n, FILTER_WORDS, world)
                       for n in range(1, entry["sampled"] + 1)), where + describe([c])
    no_lane = next(e for e in result["steps"] if e["label"] == "no-logprob-lane")
    assert not [c for c in no_lane["log"] if c.dims and c.dims[-1] == EXCHANGE2_WORDS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("wide-vocab"), vocab_size=VOCAB)


@pytest.mark.parametrize("world", [2, 4])
def test_only_fixed_width_exchanges_cross_ranks(world: int, model_dir: Path) -> None:
    per_rank = run_ranks(rank_main, world, str(model_dir), timeout_s=240.0)
    for rank, result in enumerate(per_rank):
        check_reduction(world, result["reduction"])
        check_steps(world, result)
        # Every rank logged the same collectives (same shapes, same order) and tokens.
        assert result["outputs"] == per_rank[0]["outputs"], rank
        for mine, first in zip(result["steps"], per_rank[0]["steps"], strict=True):
            assert mine["log"] == first["log"], (rank, mine["label"])
    assert all(len(out) >= 2 for out in per_rank[0]["outputs"].values())
