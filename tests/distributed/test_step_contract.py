"""The rank step's logprob contract at TP2 over gloo, in one launch: every rank gates the same
rows from the committed records, a K=5 core serves natural alternatives, a core without
logprob outputs builds and writes nothing, and the Triton backend (interpreted on CPU) is
prepared before its first logprob step."""

from __future__ import annotations

import math

import pytest
import torch

from helios_logprobs.kernels.layout import FIRST_PAIR
from helios_logprobs.kernels.sortkeys import bits_to_float
from helios_logprobs.ranks.contract import abi6
from tests.checkpoints import hf_logprobs, write_qwen2
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

SENTINEL = -7
PROMPTS = {3: (5, 6, 7), 1: (8, 9)}
"""Slot -> prompt of the plan's two sampling rows (slot 3 is row 0, slot 1 is row 1)."""
TOL = 1e-4


def plan(logprob_ids: tuple[int, ...] = (), logprobs: bool = True):
    from helios_logprobs.ranks.plan import RequestSpec, SlotWork, StepPlan
    from helios_logprobs.ranks.sampler.params import RowSampling

    def spec(ordinal: int, ids: tuple[int, ...] = ()) -> RequestSpec:
        sampling = RowSampling(seed=ordinal, position=0, temperature=0.0)
        return RequestSpec(ordinal=ordinal, max_tokens=4, sampling=sampling,
                           wants_logprobs=logprobs, logprob_token_ids=ids)

    return StepPlan(0, (
        SlotWork(3, 1, PROMPTS[3], 0, True, spec(1)),
        SlotWork(0, 1, (9, 10, 11), 0, False, spec(2)),
        SlotWork(1, 1, PROMPTS[1], 0, True, spec(3, logprob_ids)),
    ))


def frame(step) -> dict:
    return {"records": step.outputs.completion_records[0].clone(),
            "payload": step.outputs.completion_logprobs[0].clone()}


def rank_main(model_dir: str) -> dict:
    """Every scenario on this rank; the parent compares ranks and checks the values."""
    from helios_logprobs.collectives.groups import world_group
    from helios_logprobs.kernels import sharded
    from helios_logprobs.kernels.triton import sharded as triton_sharded
    from helios_logprobs.ranks import commit
    from helios_logprobs.runtime.engine.bootstrap import load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    group = world_group()

    def step_for(**overrides):
        config = RuntimeConfig(model_dir=model_dir, **{"capacity": 4, "max_model_len": 32,
                                                       **overrides})
        return load_rank(config, group)

    results = {}
    # The record of slot 3 loses its emitted token after the commit writer: every rank skips
    # that row, and the exchanges still line up.
    flush = commit.RecordBatch.flush

    def corrupting(self, records):
        flush(self, records)
        records[3, abi6.EMITTED] = 0

    commit.RecordBatch.flush = corrupting
    step = step_for()
    step.outputs.completion_logprobs.fill_(SENTINEL)
    step.run(plan(logprob_ids=(299, 0, 150)))
    commit.RecordBatch.flush = flush
    results["gated"] = frame(step)

    step = step_for(max_logprobs=5)
    step.run(plan())
    results["k5"] = frame(step)

    built = []
    init = sharded.PreparedShardedReduction.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    sharded.PreparedShardedReduction.__init__ = counting
    step = step_for(logprobs=False)
    sharded.PreparedShardedReduction.__init__ = init
    step.outputs.logprob_requested.fill_(SENTINEL)
    step.run(plan(logprobs=False))
    results["off"] = {"built": len(built), "reduction": step.reduction is None,
                      "flags": step.outputs.logprob_requested.clone(), **frame(step)}

    triton_sharded._PREPARED.clear()
    step = step_for(reduction_backend="triton")

    def snapshot():
        return {str(key): [(id(p), p.rows, sorted(p._starts)) for p in entries]
                for key, entries in triton_sharded._PREPARED.items()}

    before = snapshot()
    step.run(plan())
    results["triton"] = {"before": before, "after": snapshot(), **frame(step)}
    return results


def check_natural(record, words, ref_row, k: int) -> None:
    token = int(record[abi6.HEADER])
    assert int(words[0]) == token
    assert math.isclose(float(bits_to_float(words[1:2])[0]), float(ref_row[token]), abs_tol=TOL)
    pairs = words[FIRST_PAIR : FIRST_PAIR + 2 * k].view(-1, 2)
    ids = pairs[:, 0].tolist()
    values = bits_to_float(pairs[:, 1]).tolist()
    ranking = sorted(range(ref_row.numel()), key=lambda i: (-float(ref_row[i]), i))
    assert ids == ranking[:k]
    for tid, value in zip(ids, values, strict=True):
        assert math.isclose(value, float(ref_row[tid]), abs_tol=TOL)


def test_step_contract_tp2(tmp_path):
    model_dir = write_qwen2(tmp_path / "qwen2")
    ranks = run_ranks(rank_main, 2, str(model_dir), timeout_s=240.0)
    for name in ranks[0]:
        for key in ("records", "payload"):
            assert torch.equal(ranks[0][name][key], ranks[1][name][key]), (name, key)
    refs = {slot: hf_logprobs(model_dir, list(prompt))[-1] for slot, prompt in PROMPTS.items()}

    gated = ranks[0]["gated"]
    assert torch.all(gated["payload"][3] == SENTINEL)
    assert int(gated["records"][1, abi6.FIRST_LOGIT_ROW]) == 1
    words = gated["payload"][1, 0]
    assert words[FIRST_PAIR : FIRST_PAIR + 6 : 2].tolist() == [299, 0, 150]
    for j, tid in enumerate((299, 0, 150)):
        value = float(bits_to_float(words[FIRST_PAIR + 2 * j + 1 : FIRST_PAIR + 2 * j + 2])[0])
        assert math.isclose(value, float(refs[1][tid]), abs_tol=TOL)

    k5 = ranks[0]["k5"]
    assert k5["payload"].shape[-1] == 2 + 2 * 5
    for slot in PROMPTS:
        check_natural(k5["records"][slot], k5["payload"][slot, 0], refs[slot], 5)

    for rank in ranks:
        off = rank["off"]
        assert off["built"] == 0 and off["reduction"]
        assert torch.all(off["flags"] == SENTINEL)
        assert int(off["records"][3, abi6.EMITTED]) == 1

    for rank in ranks:
        triton = rank["triton"]
        assert triton["before"] and triton["after"] == triton["before"]
        for slot in PROMPTS:
            check_natural(triton["records"][slot], triton["payload"][slot, 0], refs[slot], 20)
