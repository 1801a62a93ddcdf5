"""The torch backend and the reference against an independent float64 oracle, and each other.

Oracle (tests/oracles.py, shares no code with kernels/): float64 log-softmax of the FP32 logits
over the real vocabulary, ranked by (value desc, id asc). FP32 results must match it within
a per-row tolerance; ids must match exactly where the oracle's gaps exceed the tolerance,
and within the output equal values must come in ascending id order.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helios_logprobs.kernels.api import pack_token_ids, reduce_logprobs, reduce_logprobs_sharded
from helios_logprobs.kernels.cpu import compiled
from helios_logprobs.kernels.cpu.backend import reduce_torch
from helios_logprobs.kernels.rows import RowRequest
from tests.oracles import WORDS, check_payload, check_row, f32_values, tolerance


def run_all(logits, chosen, *, k, vocab, token_ids, requested, tile):
    """(reference, torch via the API, torch with an explicit tile) payloads."""
    kw = dict(k=k, token_ids=token_ids, vocab_size=vocab, requested=requested)
    ref = reduce_logprobs(logits, chosen, backend="reference", **kw)
    api = reduce_logprobs(logits, chosen, backend="torch", **kw)
    ids, counts = pack_token_ids(token_ids, logits.shape[0], vocab)
    flags = torch.ones(logits.shape[0], dtype=torch.int32) if requested is None else requested
    tiled = torch.full((logits.shape[0], WORDS), -1, dtype=torch.int32)
    reduce_torch(logits, RowRequest(chosen, ids, counts, flags, k), vocab, tiled, tile=tile)
    return ref, api, tiled


def make_logits(kind: str, rows: int, vocab: int, pad: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    if kind == "ties":  # many exact ties, including at the top-K cutoff
        x = torch.randint(-2, 3, (rows, vocab), generator=g).double()
    elif kind == "subtraction":  # distinct logits closer than an ulp of the result
        x = 1.0 + torch.randint(0, 8, (rows, vocab), generator=g).double() * 2.0**-23
        x[:, 0] = 20.0  # lse ~ 20: x - lse ~ -19, where FP32 steps are 2^-19
    elif kind == "signed_zero":
        x = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, -0.0, 0.0).double()
        x[:, vocab // 2 :] -= 1.0
    elif kind == "neg_inf":
        x[torch.rand(rows, vocab, generator=g) < 0.7] = -math.inf
        x[:, 0] = 0.5
    elif kind == "huge":
        x[:, int(torch.randint(0, vocab, (1,), generator=g))] = 1e30
    elif kind == "scaled":
        x = x * 1000.0
    elif kind == "far_negative":  # a finite logit far below the rest: no looser check for it
        x[:, int(torch.randint(0, vocab, (1,), generator=g))] = -1e30
    garbage = torch.tensor([math.nan, math.inf, 1e30, -math.inf], dtype=torch.float64)
    padding = garbage[torch.randint(0, 4, (rows, pad), generator=g)]
    return torch.cat([x, padding], dim=1).to(torch.float32)


KINDS = ["normal", "ties", "subtraction", "signed_zero", "neg_inf", "huge", "scaled",
         "far_negative"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw):
    vocab = draw(st.sampled_from([1, 2, 7, 19, 20, 21, 64, 423, 1000, 5000]))
    rows = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    if kind in ("subtraction", "huge", "scaled", "far_negative") and dtype != torch.float32:
        dtype = torch.float32  # these values only exist in FP32
    seed = draw(st.integers(0, 2**30))
    logits = make_logits(kind, rows, vocab, draw(st.sampled_from([0, 1, 17])), seed).to(dtype)
    chosen = torch.tensor([draw(st.integers(0, vocab - 1)) for _ in range(rows)])
    requested = torch.tensor([draw(st.integers(0, 1)) for _ in range(rows)], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    token_ids = []
    for _ in range(rows):
        n = min(draw(st.sampled_from([0, 0, 1, 5, 128])), vocab)
        token_ids.append(torch.randperm(vocab, generator=g)[:n].tolist())
    k = draw(st.integers(0, 20))
    tile = draw(st.sampled_from([16, 64, 512, 4096]))
    return logits, chosen, requested, token_ids, k, vocab, tile


@settings(max_examples=150, deadline=None)
@given(cases())
def test_torch_and_reference_match_float64_oracle(case) -> None:
    logits, chosen, requested, token_ids, k, vocab, tile = case
    outs = run_all(
        logits, chosen, k=k, vocab=vocab, token_ids=token_ids, requested=requested, tile=tile
    )
    for out in outs:
        check_payload(out, logits, vocab, chosen, k, token_ids, requested)
        assert torch.all(out[requested == 0] == -1), "unrequested rows must stay untouched"


BACKENDS = ["reference", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_far_negative_logit_does_not_loosen_the_check(backend: str) -> None:
    """Rows holding a -1e30 logit: the other values are still checked to FP32 precision at the
    lse's scale (a tolerance that grew with the largest |logit| would accept errors of 1e24)."""
    x = make_logits("far_negative", 4, 1000, 5, 7)
    chosen = torch.tensor([0, 999, 500, 17])
    out = reduce_logprobs(x, chosen, vocab_size=1000, backend=backend)
    check_payload(out, x, 1000, chosen, 20, None, None)
    lse = float(torch.logsumexp(x[0, :1000].double(), 0))
    assert tolerance(lse, -3.0) < 2e-5  # lse ~ 11: about 90 FP32 ulps of it


def _pairs(out: torch.Tensor, row: int = 0) -> tuple[list[int], list[float]]:
    w = out[row].tolist()
    return w[2::2], f32_values(w[3::2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_subtraction_ties_select_the_smaller_id(backend: str) -> None:
    """Ids 3 and 7 have distinct FP32 logits (7's is larger), but x - lse rounds both to
    -19.0: the reported values tie, so the smaller id ranks first; the float64 oracle would
    rank 7 first. The remaining ids tie exactly and follow in ascending order."""
    x = torch.full((1, 50), -100.0)
    x[0, 10] = 20.0
    x[0, 3] = 1.0 + 2.0**-22
    x[0, 7] = 1.0 + 3 * 2.0**-23
    assert float(x[0, 7]) > float(x[0, 3])
    out = reduce_logprobs(x, torch.tensor([7]), backend=backend)
    ids, vals = _pairs(out)
    rest = [i for i in range(50) if i not in (3, 7, 10)]
    assert ids[:20] == [10, 3, 7, *rest[:17]]
    assert vals[1] == vals[2] == -19.0
    assert out[0, 1] == out[0, 7]  # the chosen value is the same FP32 value as pair 2's
    check_row(out[0], x[0], 50, 7, 20, [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_below_the_prefilter_floor_are_kept(backend: str) -> None:
    """Each 8-chunk group of the tile holds one lane 1 + 7u (u = 2^-23), so the torch
    prefilter's raw floor candidate is 1 + 7u; lanes 0..39 hold 1.0, below it, yet x - lse
    rounds every one of these 72 lanes to -19.0: the tie admits the smallest ids."""
    x = torch.full((1, 4096), -100.0)
    x[0, 4095] = 20.0
    x[0, 3840:4096:8][:32] = 1.0 + 7 * 2.0**-23
    x[0, :40] = 1.0
    out = reduce_logprobs(x, torch.tensor([3840]), backend=backend)
    ids, vals = _pairs(out)
    assert ids[:20] == [4095, *range(19)]
    assert vals[1:20] == [-19.0] * 19
    assert f32_values([int(out[0, 1])]) == [-19.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_at_the_cutoff_keep_the_smallest_ids(backend: str) -> None:
    x = torch.zeros(2, 9000, dtype=torch.bfloat16)
    x[0, 4100::7] = 1.0  # 700 tied maxima, spread over tiles
    x[1] = 0.25  # the whole row ties
    out = reduce_logprobs(x, torch.tensor([0, 8999]), backend=backend)
    assert _pairs(out, 0)[0][:20] == list(range(4100, 4100 + 7 * 20, 7))
    assert _pairs(out, 1)[0][:20] == list(range(20))
    check_payload(out, x, 9000, torch.tensor([0, 8999]), 20, None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_signed_zero_vocab_one_and_vocab_below_k(backend: str) -> None:
    one = reduce_logprobs(torch.tensor([[-0.0]]), torch.tensor([0]), backend=backend)
    assert one[0, :4].tolist()[0::2] == [0, 0] and _pairs(one)[1][0] == 0.0
    assert one[0, 1].item() in (0, -(2**31))  # +0.0 or -0.0: both are logprob 0
    assert torch.all(one[0, 4:] == -1)
    x = torch.tensor([[0.0, -0.0, -0.0, 0.0, -1.0]])
    out = reduce_logprobs(x, torch.tensor([4]), backend=backend)
    ids, vals = _pairs(out)
    assert ids[:5] == [0, 1, 2, 3, 4]
    assert ids[5:] == [-1] * 123 and torch.all(out[0, 12:] == -1)
    assert vals[0] == vals[1] == vals[2] == vals[3] > vals[4]
    check_row(out[0], x[0], 5, 4, 20, [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_lanes_and_bad_rows(backend: str) -> None:
    x = torch.full((4, 30), -math.inf)
    x[0, [4, 9, 17]] = torch.tensor([1.0, 2.0, 1.0])
    x[1, 5] = math.nan
    x[2, 6] = math.inf
    # row 3: every lane -inf
    out = reduce_logprobs(x, torch.tensor([9, 5, 6, 0]), backend=backend)
    ids, vals = _pairs(out, 0)
    assert ids[:20] == [9, 4, 17, *[i for i in range(30) if i not in (4, 9, 17)][:17]]
    assert vals[3:20] == [-math.inf] * 17
    for row in (1, 2, 3):
        assert math.isnan(f32_values([int(out[row, 1])])[0])
        assert all(-1 <= i < 30 for i in _pairs(out, row)[0])
    check_payload(out, x, 30, torch.tensor([9, 5, 6, 0]), 20, None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_all_neg_inf_tile_contributes_nothing(backend: str) -> None:
    x = torch.randn(2, 9000, dtype=torch.float64).to(torch.bfloat16)
    x[:, :4096] = -math.inf  # one whole tile (and half the next for row 1)
    x[1, 4096:6000] = -math.inf
    chosen = torch.tensor([4096, 8999])
    out = reduce_logprobs(x, chosen, backend=backend)
    check_payload(out, x, 9000, chosen, 20, None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logit_and_padding_garbage(backend: str) -> None:
    x = torch.randn(2, 430) * 3
    x[0, 77] = 1e30
    x[1, 3] = 3.0e38
    x[:, 423:] = torch.tensor([math.nan, math.inf, 3e38, -math.inf, 1e30, math.nan, math.inf])
    out = reduce_logprobs(x, torch.tensor([77, 5]), vocab_size=423, backend=backend)
    assert _pairs(out, 0)[0][0] == 77 and _pairs(out, 0)[1][0] == 0.0
    assert _pairs(out, 0)[0][1:20] == [i for i in range(20) if i != 77][:19]  # all tie
    check_payload(out, x, 423, torch.tensor([77, 5]), 20, None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selected_ids_in_caller_order(backend: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 1000, generator=g) * 3).to(torch.bfloat16)
    order = torch.argsort(x[1].float(), descending=True, stable=True).tolist()
    picks = [order[-1], order[500], order[0], 999, 0]  # mostly outside the natural top-K
    full = torch.randperm(1000, generator=g)[:128].tolist()
    chosen = torch.tensor([5, order[-1], 17])  # row 1: chosen is the least likely token
    out = reduce_logprobs(x, chosen, token_ids=[full, [], picks], backend=backend)
    assert _pairs(out, 0)[0] == full and _pairs(out, 2)[0][:5] == picks
    assert order[-1] not in _pairs(out, 1)[0][:20] and int(out[1, 0]) == order[-1]
    check_payload(out, x, 1000, chosen, 20, [full, [], picks], None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unrequested_rows_are_not_written(backend: str) -> None:
    x = torch.randn(4, 100)
    x[1] = math.nan  # an unrequested row's content cannot matter
    out = torch.full((4, WORDS), 0x5A5A5A5A, dtype=torch.int32)
    requested = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    reduce_logprobs(x, torch.tensor([1, 2, 3, 4]), requested=requested, out=out, backend=backend)
    assert torch.all(out[[1, 3]] == 0x5A5A5A5A)
    check_payload(out, x, 100, torch.tensor([1, 2, 3, 4]), 20, None, requested)
    none = torch.full((4, WORDS), 7, dtype=torch.int32)
    reduce_logprobs(x, torch.tensor([1] * 4), requested=torch.zeros(4), out=none, backend=backend)
    assert torch.all(none == 7)


def test_qwen_vocabulary_bf16_and_fp16() -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 151936, generator=g) * 4
    x[1, 151000:] -= 30  # a cold tail
    chosen = torch.tensor([151935, 12])
    for dtype in (torch.bfloat16, torch.float16):
        logits = x.to(dtype)
        for backend in BACKENDS:
            out = reduce_logprobs(logits, chosen, backend=backend)
            check_payload(out, logits, 151936, chosen, 20, None, None)


def test_rejects_bad_inputs() -> None:
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="chosen"):
        reduce_logprobs(x, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="chosen"):
        reduce_logprobs(x, torch.tensor([0, 9]), vocab_size=9)
    with pytest.raises(ValueError, match="vocab_size"):
        reduce_logprobs(x, torch.tensor([0, 1]), vocab_size=11)
    with pytest.raises(ValueError, match="distinct"):
        reduce_logprobs(x, torch.tensor([0, 1]), token_ids=[[1, 1], []])
    with pytest.raises(ValueError, match="backend"):
        reduce_logprobs(x, torch.tensor([0, 1]), backend="cuda")


class _BigAllocations(TorchDispatchMode):
    """Records every new tensor storage of at least `limit` bytes created by an aten op."""

    def __init__(self, limit: int, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.limit = limit
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.big: list[tuple[str, tuple, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.seen and t.untyped_storage().nbytes() >= self.limit:
                    self.big.append((str(func), tuple(t.shape), t.dtype))
                self.seen.add(ptr)
        return result


def test_torch_backend_never_allocates_a_rows_by_vocab_fp32_tensor() -> None:
    rows, vocab = 8, 40000
    x = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    chosen = torch.arange(rows)
    out = torch.full((rows, WORDS), -1, dtype=torch.int32)
    limit = rows * vocab * 4 // 2  # half of a [rows, vocab] FP32 copy
    with _BigAllocations(limit, [x, out]) as spy:  # the detector itself must work
        x.float().log_softmax(-1)
    assert spy.big, "the allocation spy failed to see the baseline's FP32 copy"
    ties = torch.zeros_like(x)  # every chunk reaches the floor: the slab-by-slab path
    for call in (
        lambda: reduce_logprobs(x, chosen, out=out),
        lambda: reduce_logprobs(ties, chosen, out=out),
        lambda: reduce_logprobs(x, chosen, out=out, requested=torch.tensor([1, 0] * 4)),
        lambda: reduce_logprobs_sharded(
            x, chosen, vocab_start=0, vocab_size=vocab, group=None, out=out
        ),
    ):
        with _BigAllocations(limit, [x, ties, out]) as spy:
            call()
        assert not spy.big, f"large allocations: {spy.big}"
    check_payload(out, x, vocab, chosen, 20, None, None)


def test_stale_ids_beyond_the_count_are_ignored() -> None:
    """Backends take raw id/count tensors: slots past a row's count may hold another
    request's ids (or anything); they are neither read as ids nor written."""
    from helios_logprobs.kernels.sharded import PreparedShardedReduction

    x = torch.randn(3, 300)
    chosen = torch.tensor([1, 2, 3])
    ids, counts = pack_token_ids([[7, 5], [], [299]], 3, 300)
    ids[:, 2:] = 10**6
    ids[1, :] = -(10**6)  # count 0: natural alternatives, the ids are noise
    flags = torch.ones(3, dtype=torch.int32)
    want = reduce_logprobs(x, chosen, token_ids=[[7, 5], [], [299]], backend="reference")
    direct = torch.full((3, WORDS), -1, dtype=torch.int32)
    request = RowRequest(chosen, ids, counts, flags, 20)
    reduce_torch(x, request, 300, direct)
    sharded = torch.full((3, WORDS), -1, dtype=torch.int32)
    PreparedShardedReduction(None, 3, 300, 0, 300, 300, "torch", "cpu")(x, request, sharded)
    for out in (direct, sharded):
        assert torch.equal(out[:, 0::2], want[:, 0::2])
        check_payload(out, x, 300, chosen, 20, [[7, 5], [], [299]], None)


def test_strided_logits_views() -> None:
    """Row-strided (a column slice) and lane-strided (a transpose) views read the right
    lanes: the launch-3 gather addresses storage through the view's strides."""
    g = torch.Generator().manual_seed(5)
    big = (torch.randn(3, 9000, generator=g) * 3).to(torch.bfloat16)
    chosen = torch.tensor([0, 4096, 8191])
    sliced = big[:, 7 : 7 + 8192]
    lanes_strided = big[:, 7 : 7 + 8192].t().contiguous().t()
    assert sliced.stride() == (9000, 1) and lanes_strided.stride() == (1, 3)
    for x in (sliced, lanes_strided):
        out = reduce_logprobs(x, chosen)
        check_payload(out, x, 8192, chosen, 20, None, None)


@pytest.mark.parametrize("vocab", [7, 1031, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduction_never_writes_the_logits(vocab: int, dtype: torch.dtype) -> None:
    x = (torch.randn(5, vocab) * 4).to(dtype)
    before = x.clone()
    reduce_logprobs(x, torch.arange(5) % vocab)
    reduce_logprobs(x, torch.arange(5) % vocab, token_ids=[[0], [], [1], [], [vocab - 1]])
    assert torch.equal(x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def _tile_by_tile(monkeypatch) -> None:
    """Force the tile-by-tile launches (the implementation the CPU fast path reproduces)."""
    import helios_logprobs.kernels.cpu.lean as lean

    monkeypatch.setattr(lean, "LEAN", False)


FAST_CASES = [
    (vocab, kind, dtype)
    for vocab in (7, 21, 300, 1031, 4096, 4097, 9000, 40000)
    for kind in KINDS
    for dtype in (torch.float32, torch.bfloat16)
    if not (kind in ("subtraction", "huge", "scaled") and dtype != torch.float32)
]


@pytest.mark.parametrize(("vocab", "kind", "dtype"), FAST_CASES)
@pytest.mark.parametrize("compiled_on", [True, False])
def test_cpu_fast_path_is_bit_identical_to_tile_by_tile(monkeypatch, vocab, kind, dtype,
                                                         compiled_on):
    """The CPU fast path (compiled launches where the machine allows, else the same slabs
    with fewer ops, candidates from chunk maxima or from each slab, numpy bookkeeping)
    reports exactly the tile-by-tile launches' words, including rows that fall back to them
    (ties across the boundary, -inf rows, NaN/inf lanes), selected ids, unrequested rows,
    one-row calls, row subsets, and the sharded steps."""
    if not compiled_on:
        monkeypatch.setitem(compiled._STATE, "lib", None)
    rows = 5
    x = make_logits(kind, rows, vocab, 3, seed=vocab).to(dtype)
    if kind == "normal":
        x[3, vocab // 2] = math.nan
    chosen = torch.arange(rows) * 7 % vocab
    requested = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    token_ids = [[], [vocab - 1, 0], [], [], [min(5, vocab - 1)]]
    calls = [
        lambda: reduce_logprobs(x, chosen, vocab_size=vocab),
        lambda: reduce_logprobs(x[1:2], chosen[1:2], vocab_size=vocab),
        lambda: reduce_logprobs(x, chosen, vocab_size=vocab, requested=requested, k=5),
        lambda: reduce_logprobs(x, chosen, vocab_size=vocab, token_ids=token_ids),
        lambda: reduce_logprobs_sharded(
            x, chosen, vocab_start=0, vocab_size=vocab, group=None, requested=requested
        ),
        lambda: reduce_logprobs_sharded(x, chosen, vocab_start=0, vocab_size=vocab, group=None),
    ]
    fast = [call() for call in calls]
    with monkeypatch.context() as m:
        _tile_by_tile(m)
        slow = [call() for call in calls]
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tile", [16, 64, 512])
def test_cpu_fast_path_with_small_tiles(monkeypatch, tile):
    """Small tiles (many tiles per row, candidates picked per slab or from chunks)."""
    g = torch.Generator().manual_seed(tile)
    for vocab in (300, 1000, 5000):
        x = (torch.randn(3, vocab, generator=g) * 3).to(torch.bfloat16)
        chosen = torch.tensor([0, vocab // 2, vocab - 1])
        ids, counts = pack_token_ids(None, 3, vocab)
        flags = torch.ones(3, dtype=torch.int32)
        outs = []
        for lean, lib in ((True, compiled._lib()), (True, None), (False, None)):
            with monkeypatch.context() as m:
                m.setattr("helios_logprobs.kernels.cpu.lean.LEAN", lean)
                m.setitem(compiled._STATE, "lib", lib)
                out = torch.full((3, WORDS), -1, dtype=torch.int32)
                reduce_torch(x, RowRequest(chosen, ids, counts, flags, 20), vocab, out,
                             tile=tile)
                outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_sharded_cpu_steps_match_tile_steps_on_several_shards(monkeypatch):
    """Three simulated shards through the three step functions: the CPU fast path and the
    tile-by-tile steps produce the same payload."""
    from helios_logprobs.kernels.cpu import sharded as steps
    from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS

    vocab, rows, width = 10_007, 4, 3336
    full = make_logits("ties", rows, vocab, 0, seed=11).to(torch.bfloat16)
    full[1] = make_logits("normal", 1, vocab, 0, seed=12).to(torch.bfloat16)
    shards = [(full[:, s : s + width], s, min(width, vocab - s)) for s in (0, 3336, 6672)]
    starts = [0, 3336, 6672, vocab]
    ids, counts = pack_token_ids([[], [3, 9000], [], []], rows, vocab)
    request = RowRequest(torch.tensor([5, 3335, 3336, 10_006]), ids, counts,
                         torch.ones(rows, dtype=torch.int32), 20)

    def run():
        e1 = torch.zeros(3, rows, EXCHANGE1_WORDS, dtype=torch.int32)
        for i, (x, _, valid) in enumerate(shards):
            steps.shard_stats(x, request, valid, e1[i])
        e2 = torch.empty(3, rows, EXCHANGE2_WORDS, dtype=torch.int32)
        lse = torch.empty(rows)
        for i, (x, start, valid) in enumerate(shards):
            steps.shard_candidates(x, request, e1, start, valid, lse, e2[i])
        out = torch.full((rows, WORDS), -1, dtype=torch.int32)
        steps.final_merge(e2, lse, request, starts, out)
        return out

    fast = run()
    with monkeypatch.context() as m:
        _tile_by_tile(m)
        slow = run()
    assert torch.equal(fast, slow)
    check_payload(fast, full, vocab, request.chosen, 20, [[], [3, 9000], [], []], None)


@pytest.mark.parametrize(("rows", "vocab", "flagged"), [(1, 151_936, 1), (16, 1031, 16),
                                                        (16, 1031, 1)])
def test_one_row_and_decode_shapes_never_hold_a_rows_by_vocab_fp32_tensor(rows, vocab,
                                                                         flagged):
    """The shapes the CPU fast path serves most (one row; decode's [capacity, vocab]) touch
    no tensor storage of half a [rows, vocabulary] FP32 copy or more."""
    x = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    chosen = torch.arange(rows) % vocab
    requested = (torch.arange(rows) < flagged).to(torch.int32)
    out = torch.full((rows, WORDS), -1, dtype=torch.int32)
    limit = rows * vocab * 4 // 2
    for call in (
        lambda: reduce_logprobs(x, chosen, out=out, requested=requested),
        lambda: reduce_logprobs_sharded(x, chosen, vocab_start=0, vocab_size=vocab,
                                        group=None, out=out, requested=requested),
    ):
        with _BigAllocations(limit, [x, out]) as spy:
            call()
        assert not spy.big, f"large allocations: {spy.big}"


@pytest.mark.parametrize(("rows", "vocab", "flagged"), [(3, 1031, 2), (2, 40_000, 2)])
def test_one_rank_driver_equals_the_shard_steps(rows, vocab, flagged):
    """A size-1 group runs reduce_torch instead of the shard steps: the same payload bits."""
    from helios_logprobs.kernels.cpu import sharded as steps
    from helios_logprobs.kernels.layout import EXCHANGE1_WORDS, EXCHANGE2_WORDS
    from helios_logprobs.kernels.sharded import PreparedShardedReduction

    x = make_logits("ties", rows, vocab, 0, seed=5)
    ids, counts = pack_token_ids([[], [7, 0]][:rows] + [[]] * (rows - 2), rows, vocab)
    flags = (torch.arange(rows) < flagged).to(torch.int32)
    request = RowRequest(torch.arange(rows) * 13 % vocab, ids, counts, flags, 20)
    driver = PreparedShardedReduction(None, rows, vocab, 0, vocab, vocab, "torch", "cpu")
    assert driver.whole is reduce_torch
    out = driver(x, request, torch.full((rows, WORDS), -1, dtype=torch.int32))
    e1 = torch.zeros(1, rows, EXCHANGE1_WORDS, dtype=torch.int32)
    steps.shard_stats(x, request, vocab, e1[0])
    e2 = torch.empty(1, rows, EXCHANGE2_WORDS, dtype=torch.int32)
    lse = torch.empty(rows)
    steps.shard_candidates(x, request, e1, 0, vocab, lse, e2[0])
    expected = torch.full((rows, WORDS), -1, dtype=torch.int32)
    steps.final_merge(e2, lse, request, [0, vocab], expected)
    assert torch.equal(out, expected)
