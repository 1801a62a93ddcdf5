"""Vocabulary-sharded reduction on real gloo groups (TP1, TP2, TP4): every rank returns the
same payload as the unsharded reduction of the full row, within FP32 tolerance and with the
same id order, and each call runs exactly two collectives: int32 all-gathers of [rows, 2]
and [rows, 129] words per rank, as recorded at the c10d dispatcher
(tests/distributed/collective_log.py), not as the exchange counts its own bytes.

One process launch per world size; each runs many cases. ``BACKENDS`` is the parameter a
GPU/Triton test module can reuse with ``run_sharded_cases`` from here.
"""

from __future__ import annotations

import math

import pytest
import torch

from helios_logprobs.kernels.api import reduce_logprobs
from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS, PAYLOAD_WORDS
from tests.distributed.harness import run_ranks
from tests.oracles import check_payload, tolerance

BACKENDS = ["torch"]
SENTINEL = 0x5A5A5A5A


def sharded_worker(backend: str, cases: list[dict]) -> list[dict]:
    """Runs on every rank: this rank's shard of each case, twice (determinism); the second
    call (prepared state cached) with every collective recorded."""
    from helios_logprobs.collectives.groups import group_rank, world_group
    from helios_logprobs.kernels.api import reduce_logprobs_sharded
    from tests.distributed.collective_log import record_collectives

    group = world_group()
    rank = group_rank(group)
    results = []
    for case in cases:
        start, width = case["starts"][rank], case["widths"][rank]
        local = case["logits"][:, start : start + width].contiguous()
        rows = local.shape[0]
        outs = []
        for _ in range(2):
            out = torch.full((rows, PAYLOAD_WORDS), SENTINEL, dtype=torch.int32)
            with record_collectives() as log:
                reduce_logprobs_sharded(
                    local, case["chosen"], vocab_start=start, vocab_size=case["vocab"],
                    group=group, k=case["k"], token_ids=case["token_ids"],
                    requested=case["requested"], out=out, backend=backend,
                )
            outs.append(out)
        results.append({"out": outs[0], "repeat_equal": torch.equal(*outs), "log": list(log)})
    return results


def exchanged(log: list) -> list[tuple]:
    """(operator, dtypes, shapes) of each recorded collective."""
    return [(c.op, sorted(map(str, c.dtypes)), sorted(c.shapes())) for c in log]


def expected_exchanges(rows: int, world: int) -> list[tuple]:
    if world == 1:
        return []
    return [("_allgather_base_", ["torch.int32"], sorted([(world * rows, words), (rows, words)]))
            for words in (EXCHANGE1_WORDS, EXCHANGE2_WORDS)]


def make_case(
    seed: int,
    vocab: int,
    widths: list[int],
    *,
    rows: int = 4,
    dtype: torch.dtype = torch.float32,
    k: int = 20,
    kind: str = "normal",
    selected: bool = False,
    requested: list[int] | None = None,
) -> dict:
    """Shards are consecutive ranges of `widths` lanes; lanes >= vocab hold garbage. Row r's
    chosen id (and its first selected id) belongs to rank r % world."""
    g = torch.Generator().manual_seed(seed)
    starts = [sum(widths[:r]) for r in range(len(widths))]
    total = starts[-1] + widths[-1]
    assert total >= vocab
    x = torch.randn(rows, total, generator=g, dtype=torch.float64) * 3
    if kind == "ties":
        x = torch.randint(-1, 2, (rows, total), generator=g).double()
    elif kind == "equal":
        x = torch.full((rows, total), 0.5, dtype=torch.float64)
    garbage = torch.tensor([math.nan, math.inf, 1e30, -math.inf], dtype=torch.float64)
    x[:, vocab:] = garbage[torch.randint(0, 4, (rows, total - vocab), generator=g)]
    owned = [(lo, min(lo + w, vocab)) for lo, w in zip(starts, widths, strict=True)]
    owners = [r for r, (lo, hi) in enumerate(owned) if hi > lo]
    chosen, token_ids = [], []
    for row in range(rows):
        lo, hi = owned[owners[row % len(owners)]]
        chosen.append(int(torch.randint(lo, hi, (1,), generator=g)))
        if selected and row % 2 == 0:
            ids = torch.randperm(vocab, generator=g)[: min(vocab, 40)].tolist()
            first = int(torch.randint(lo, hi, (1,), generator=g))
            token_ids.append([first, *[i for i in ids if i != first]][:40])
        else:
            token_ids.append([])
    flags = [1] * rows if requested is None else requested
    return {
        "logits": x.to(torch.float32).to(dtype), "vocab": vocab, "starts": starts,
        "widths": widths, "chosen": torch.tensor(chosen), "k": k, "token_ids": token_ids,
        "requested": torch.tensor(flags, dtype=torch.int32),
    }


def even(vocab: int, world: int) -> list[int]:
    return [-(-vocab // world)] * world


def cases_for(world: int) -> list[dict]:
    if world == 1:
        return [
            make_case(1, 423, [430], selected=True),
            make_case(2, 1000, [1000], dtype=torch.bfloat16, requested=[1, 0, 1, 0]),
            make_case(3, 5, [8], k=20),
        ]
    if world == 2:
        return [
            make_case(10, 9000, even(9000, 2), selected=True),
            make_case(11, 423, even(423, 2), dtype=torch.bfloat16, requested=[0, 1, 1, 0]),
            make_case(12, 423, [100, 330], k=7, selected=True),
            make_case(13, 5, [3, 3], k=20),
            make_case(14, 1, [1, 1], k=20),
            make_case(15, 151936, even(151936, 2), rows=2, dtype=torch.bfloat16),
            make_case(16, 5000, even(5000, 2), kind="ties", k=0),
        ]
    return [
        make_case(20, 423, even(423, 4), selected=True),
        make_case(21, 3, [1, 1, 1, 1], k=20),
        make_case(22, 423, [50, 200, 1, 177], selected=True, requested=[1, 1, 0, 1]),
        make_case(23, 9000, even(9000, 4), dtype=torch.float16, selected=True, rows=8),
        make_case(24, 9000, even(9000, 4), kind="ties"),
        make_case(25, 700, [0, 300, 0, 400], kind="equal", k=20),
    ]


def run_sharded_cases(backend: str, world: int) -> None:
    cases = cases_for(world)
    per_rank = run_ranks(sharded_worker, world, backend, cases, timeout_s=240.0)
    for i, case in enumerate(cases):
        got = [per_rank[r][i] for r in range(world)]
        out = got[0]["out"]
        for r in range(world):
            assert torch.equal(got[r]["out"], out), f"case {i}: rank {r} differs from rank 0"
            assert got[r]["repeat_equal"], f"case {i}: rank {r} not deterministic"
            want = expected_exchanges(case["logits"].shape[0], world)
            assert exchanged(got[r]["log"]) == want, f"case {i}: rank {r}"
        _compare_with_unsharded(i, case, out)


def _compare_with_unsharded(i: int, case: dict, out: torch.Tensor) -> None:
    vocab, flags = case["vocab"], case["requested"]
    logits = case["logits"]
    want = torch.full_like(out, SENTINEL)
    reduce_logprobs(
        logits, case["chosen"], k=case["k"], token_ids=case["token_ids"], vocab_size=vocab,
        requested=flags, out=want, backend="torch",
    )
    live = flags != 0
    assert torch.all(out[~live] == SENTINEL), f"case {i}: an unrequested row was written"
    assert torch.equal(out[live][:, 0::2], want[live][:, 0::2]), f"case {i}: ids differ"
    got_v = out[live][:, 1::2].view(torch.float32).double()
    want_v = want[live][:, 1::2].view(torch.float32).double()
    for j, row in enumerate(live.nonzero().flatten().tolist()):
        x = logits[row, :vocab].double()
        lse = float(torch.logsumexp(x, 0)) if bool(torch.isfinite(x).all()) else 0.0
        # Both are within tolerance of the float64 value: within twice of each other.
        tol = 2 * tolerance(lse, want_v[j].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
        same = (got_v[j] - want_v[j]).abs() <= tol
        same |= (got_v[j] == want_v[j]) | (got_v[j].isnan() & want_v[j].isnan())
        assert bool(same.all()), f"case {i} row {row}: values differ beyond {tol}"
    check_payload(out, logits, vocab, case["chosen"], case["k"], case["token_ids"], flags)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_equals_unsharded(backend: str, world: int) -> None:
    run_sharded_cases(backend, world)


@pytest.mark.slow
def test_harness_reports_the_failing_rank() -> None:
    from tests.distributed.harness import RankFailed

    with pytest.raises(RankFailed) as err:
        run_ranks(_fail_on_rank_one, 2, timeout_s=120.0)
    assert err.value.rank == 1 and "boom on rank 1" in str(err.value)


def _fail_on_rank_one() -> int:
    from helios_logprobs.collectives.groups import barrier, group_rank, world_group

    rank = group_rank(world_group())
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    barrier(world_group())  # rank 0 blocks here until rank 1's exit breaks the group
    return rank


def test_shard_bounds_must_tile_the_vocabulary(monkeypatch) -> None:
    import helios_logprobs.kernels.sharded as sharded

    def check(bounds: list[tuple[int, int, int, int]], vocab: int) -> list[int]:
        """agreed_shard_starts as if the ranks had reported `bounds` (lo, hi, vocab, rows)."""
        monkeypatch.setattr(sharded, "all_gather_object", lambda mine, group: bounds)
        return sharded.agreed_shard_starts(None, 0, 0, vocab, bounds[0][3])

    assert check([(0, 5, 9, 4), (5, 9, 9, 4)], 9) == [0, 5, 9]
    assert check([(0, 3, 3, 4), (3, 3, 3, 4), (3, 3, 3, 4)], 3) == [0, 3, 3, 3]
    assert check([(0, 0, 7, 4), (0, 7, 7, 4)], 7) == [0, 0, 7]
    with pytest.raises(ValueError, match="not at"):
        check([(0, 5, 9, 4), (6, 9, 9, 4)], 9)  # gap
    with pytest.raises(ValueError, match="cover"):
        check([(0, 5, 9, 4), (5, 8, 9, 4)], 9)  # short
    with pytest.raises(ValueError, match="disagree"):
        check([(0, 5, 9, 4), (5, 9, 9, 2)], 9)  # rows differ


def test_no_group_runs_in_process_and_matches_unsharded() -> None:
    case = make_case(30, 423, [430], selected=True, requested=[1, 1, 0, 1])
    from helios_logprobs.kernels.api import reduce_logprobs_sharded

    out = torch.full((4, PAYLOAD_WORDS), SENTINEL, dtype=torch.int32)
    reduce_logprobs_sharded(
        case["logits"], case["chosen"], vocab_start=0, vocab_size=423, group=None,
        token_ids=case["token_ids"], requested=case["requested"], out=out,
    )
    _compare_with_unsharded(0, case, out)
