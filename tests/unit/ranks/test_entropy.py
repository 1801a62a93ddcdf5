"""Entropy on the reduction driver at TP1 (the whole-row path and the shard steps) against a
float64 reference, and the driver's unnormalized (``*_logits``) payload."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sharded import PreparedShardedReduction
from tests.capture_guard import HostSync, HostSyncGuard
from tests.entropy_cases import NEG_INF, TOLERANCE, VOCAB, entropy_rows, reference_entropy


def request_for(x: torch.Tensor, flags: list[int]) -> RowRequest:
    rows = x.shape[0]
    chosen = torch.where(x.isnan(), NEG_INF, x).argmax(1)
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    return RowRequest(chosen, ids, counts, torch.tensor(flags, dtype=torch.int32), 20)


@pytest.mark.parametrize("normalize", [True, False])
def test_entropy_at_tp1_equals_float64(normalize: bool):
    x = entropy_rows()
    rows = x.shape[0]
    flags = [1] * rows
    flags[2] = 0  # an unflagged row keeps its entropy word
    driver = PreparedShardedReduction(None, rows, VOCAB, 0, VOCAB, VOCAB, "torch", "cpu",
                                      normalize=normalize)
    assert (driver.whole is None) is (not normalize)
    entropy = torch.full((rows,), 123.0)
    out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32)
    driver(x, request_for(x, flags), out, entropy_out=entropy)
    want = reference_entropy(x)
    for r in range(rows):
        if not flags[r]:
            assert entropy[r] == 123.0
            continue
        if r == 10:  # NaN lanes
            assert torch.isnan(entropy[r]) and torch.isnan(want[r])
            continue
        assert abs(float(entropy[r]) - float(want[r])) <= TOLERANCE, (r, entropy[r], want[r])
    assert float(entropy[6]) == 0.0
    assert abs(float(want[7]) - torch.log(torch.tensor(float(VOCAB), dtype=torch.float64))) \
        < 1e-9


def test_entropy_of_a_row_with_an_infinite_lane_is_nan():
    x = entropy_rows()[:2].clone()
    x[1, 17] = float("inf")
    driver = PreparedShardedReduction(None, 2, VOCAB, 0, VOCAB, VOCAB, "torch", "cpu")
    entropy = torch.zeros(2)
    out = torch.full((2, PAYLOAD_WORDS), -1, dtype=torch.int32)
    driver(x, request_for(x, [1, 1]), out, entropy_out=entropy)
    assert torch.isfinite(entropy[0]) and torch.isnan(entropy[1])


def test_unnormalized_payload_reports_the_values_themselves():
    """normalize=False: the chosen value and the K alternatives are the row's own FP32
    values bit for bit, in the logprob order (value descending, id ascending), -inf kept."""
    x = entropy_rows()[[1, 5, 9]].clone()
    x[0, [10, 20, 30]] = 7.5  # a tie among the best values: smaller ids first
    rows = x.shape[0]
    driver = PreparedShardedReduction(None, rows, VOCAB, 0, VOCAB, VOCAB, "torch", "cpu",
                                      normalize=False)
    request = request_for(x, [1] * rows)
    out = driver(x, request, torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32))
    for r in range(rows):
        values = out[r, 1::2][: 1 + 20].view(torch.float32)
        ids = out[r, 0::2][: 1 + 20]
        assert int(ids[0]) == int(request.chosen[r])
        assert values[0] == x[r, int(request.chosen[r])]
        order = sorted(range(VOCAB), key=lambda j: (-float(x[r, j]), j))[:20]
        assert ids[1:].tolist() == order
        assert torch.equal(values[1:], x[r, order])
    assert out[2, 1::2][1:21].view(torch.float32)[2:].eq(NEG_INF).all()


ENTROPY_STEPS = ("whole_flagged", "write_entropy_word", "combine_flagged")


@pytest.mark.parametrize("normalize", [True, False])
def test_entropy_path_reads_no_value_on_the_host(monkeypatch, normalize: bool):
    """The entropy steps (the whole-row one at TP1, the word and the combine on the shard
    path, which normalize=False takes at TP1 too) run under a strict host-sync guard: no
    nonzero, item, tensor from host data or boolean-mask index (a captured graph could not
    replay them); and a row's entropy is bit for bit the same whichever rows are flagged."""
    from helios_logprobs.kernels import sharded

    guard = HostSyncGuard(strict=("entropy",))
    for name in ENTROPY_STEPS:
        monkeypatch.setattr(sharded, name, getattr(sharded, name))
        guard.wrap(sharded, name, "entropy")
    x = entropy_rows()
    rows = x.shape[0]
    driver = PreparedShardedReduction(None, rows, VOCAB, 0, VOCAB, VOCAB, "torch", "cpu",
                                      normalize=normalize)
    out = torch.full((rows, PAYLOAD_WORDS), -1, dtype=torch.int32)
    every = torch.full((rows,), 123.0)
    driver(x, request_for(x, [1] * rows), out, entropy_out=every)
    some = torch.full((rows,), 123.0)
    flags = [r % 3 == 1 for r in range(rows)]
    driver(x, request_for(x, [int(f) for f in flags]), out, entropy_out=some)
    assert guard.guarded["entropy"] == (2 if normalize else 4)
    for r in range(rows):
        assert torch.equal(some[r], every[r] if flags[r] else torch.tensor(123.0)) or (
            flags[r] and every[r].isnan() and some[r].isnan()), r


def test_the_guard_sees_a_host_read_in_the_entropy_path(monkeypatch):
    """(The guard above is live: a nonzero planted in the entropy step raises.)"""
    from helios_logprobs.kernels import sharded

    real = sharded.whole_flagged

    def with_nonzero(logits, flags, local_valid, entropy_out):
        torch.nonzero(flags)
        real(logits, flags, local_valid, entropy_out)

    monkeypatch.setattr(sharded, "whole_flagged", with_nonzero)
    guard = HostSyncGuard(strict=("entropy",))
    guard.wrap(sharded, "whole_flagged", "entropy")
    x = entropy_rows()
    driver = PreparedShardedReduction(None, x.shape[0], VOCAB, 0, VOCAB, VOCAB, "torch", "cpu")
    out = torch.full((x.shape[0], PAYLOAD_WORDS), -1, dtype=torch.int32)
    with pytest.raises(HostSync, match="nonzero"):
        driver(x, request_for(x, [1] * x.shape[0]), out, entropy_out=torch.zeros(x.shape[0]))
