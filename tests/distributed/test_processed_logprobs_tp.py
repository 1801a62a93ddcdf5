"""--logprobs-mode and entropy over real gloo groups (TP2, TP4): every rank's payload and
entropy equal the float64 oracle on the full row (vLLM's processor order, renormalized), on
random rows and on transformers' logits of the tiny Qwen2 (vocabulary 301: the last shard is
padded; the filters' masks give -inf lanes), the
*_logits modes report the values bit for bit, the ranks agree bit for bit, and the reduction
still makes exactly two exchanges per call, exchange 1 one word wider (tests/processed_cases.py;
TP1 in tests/unit/ranks/test_processed_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS, LOGPROBS_MODES
from tests.checkpoints import write_qwen2
from tests.distributed.harness import run_ranks
from tests.entropy_cases import TOLERANCE, entropy_rows, reference_entropy, shard_of
from tests.processed_cases import check_modes, transformers_rows

pytestmark = pytest.mark.slow
TIMEOUT_S = 180.0


def _rank_main(base: torch.Tensor) -> dict:
    from helios_logprobs.collectives.groups import group_rank, group_size, world_group
    from helios_logprobs.kernels.sharded import PreparedShardedReduction
    from tests.distributed.collective_log import record_collectives
    from tests.processed_cases import run_modes
    from tests.unit.ranks.test_entropy import request_for

    group = world_group()
    world, rank = group_size(group), group_rank(group)
    result = run_modes(group, world, rank)
    result["transformers"] = run_modes(group, world, rank, base)
    x = entropy_rows()
    local, start, valid = shard_of(x, world, rank)
    rows = x.shape[0]
    driver = PreparedShardedReduction(group, rows, local.shape[1], start, valid, x.shape[1],
                                      "torch", "cpu")
    entropy = torch.full((rows,), float("nan"))
    out = torch.full((rows, 258), -1, dtype=torch.int32)
    with record_collectives() as log:
        driver(local, request_for(x, [1] * rows), out, entropy_out=entropy)
    result["entropy_rows"] = entropy
    result["collectives"] = [(c.op, sorted(c.shapes())) for c in log]
    return result


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> torch.Tensor:
    return transformers_rows(write_qwen2(tmp_path_factory.mktemp("processed") / "qwen2"))


@pytest.mark.parametrize("world", [2, 4])
def test_modes_and_entropy_on_shards(world: int, base: torch.Tensor):
    results = run_ranks(_rank_main, world, base, timeout_s=TIMEOUT_S)
    for result in results:
        check_modes(result)
        check_modes(result["transformers"], base)
    first = results[0]
    want = reference_entropy(entropy_rows())
    got = first["entropy_rows"]
    for i in range(want.numel()):
        if torch.isnan(want[i]):
            assert torch.isnan(got[i]), i
        else:
            assert abs(float(got[i]) - float(want[i])) <= TOLERANCE, (i, got[i], want[i])
    for other in results[1:]:
        assert torch.equal(other["tokens"], first["tokens"])
        assert torch.equal(other["transformers"]["tokens"], first["transformers"]["tokens"])
        for mode in LOGPROBS_MODES:
            assert torch.equal(other[mode][0], first[mode][0]), mode
            assert torch.equal(other[mode][1], first[mode][1]), mode
        assert torch.equal(other["entropy_rows"].nan_to_num(-1), got.nan_to_num(-1))
    rows = want.numel()
    assert first["collectives"] == [
        ("_allgather_base_", sorted([(world * rows, words), (rows, words)]))
        for words in (EXCHANGE1_WORDS, EXCHANGE2_WORDS)], first["collectives"]
