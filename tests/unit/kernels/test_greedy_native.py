"""The compiled greedy pick (kernels/greedy) against torch.argmax over the NaN-as--inf rows."""

from __future__ import annotations

import pytest
import torch

from helios_logprobs.kernels.greedy import native
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.ranks.sampler.sampler import ShardedSampler

NEG_INF = float("-inf")
TILE = 2048  # (argmax.c's tile: the cases below sit on its edges)

needs_native = pytest.mark.skipif(not native.available(), reason="no compiled greedy pick here")


def oracle(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return torch.argmax(torch.where(x.isnan(), NEG_INF, x), dim=1)


def planted(rows: int, width: int, seed: int) -> torch.Tensor:
    """Row 0 random; the others plant the maximum twice in one tile and in two tiles, at the
    last lane of a short last tile, -0.0 before +0.0, only -inf, +inf twice, NaN before the
    maximum, only NaN, and a NaN in every lane but one."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 4
    plants = [
        lambda r: r.index_fill_(0, torch.tensor([width - 1, width // 2]), 50.0),
        lambda r: r.index_fill_(0, torch.tensor([(TILE + 5) % width, (TILE + 1) % width]), 50.0),
        lambda r: r.index_fill_(0, torch.tensor([width - 1]), 50.0),
        lambda r: r.fill_(NEG_INF).index_copy_(
            0, torch.tensor([width - 1, width // 3]), torch.tensor([0.0, -0.0])),
        lambda r: r.fill_(NEG_INF),
        lambda r: r.index_fill_(0, torch.tensor([width - 2, width // 2]), float("inf")),
        lambda r: r.index_fill_(0, torch.tensor([0, width // 2]), float("nan")),
        lambda r: r.fill_(float("nan")),
        lambda r: r.fill_(float("nan")).index_fill_(0, torch.tensor([width - 1]), -3.0),
    ]
    for row, plant in zip(range(1, rows), plants, strict=False):
        plant(x[row])
    return x


@pytest.fixture(params=native.VECTOR_LEVELS)
def level(request):
    """Each vector level of the pick (argmax.c: scalar, AVX2), the CPU's best one after."""
    used = native.vector_level(request.param)
    if used != request.param:
        native.vector_level()
        pytest.skip(f"this CPU has no {request.param} level")
    yield used
    native.vector_level()


@needs_native
@pytest.mark.parametrize("width", [1, 7, 31, 423, TILE - 1, TILE, TILE + 1, 32_000, 151_936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pick_is_torch_argmax_with_nan_as_minus_inf(width, dtype, level) -> None:
    x = planted(10, width + 3, width).to(dtype)[:, 2 : width + 2]  # strided rows, odd offset
    assert torch.equal(native.native_argmax(x), oracle(x))
    assert torch.equal(native.native_argmax(x[:1]), oracle(x[:1]))


@needs_native
def test_rows_split_across_threads_pick_what_one_thread_picks() -> None:
    x = planted(10, 40_000, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = native.native_argmax(x)
        torch.set_num_threads(1)
        one = native.native_argmax(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(two, one) and torch.equal(one, oracle(x))


def test_it_declines_what_it_cannot_read() -> None:
    x = torch.randn(3, 64)
    assert native.native_argmax(x.to(torch.float16)) is None
    assert native.native_argmax(x.t()) is None  # (lanes not contiguous)
    assert native.native_argmax(x[0]) is None


@needs_native
def test_rows_named_by_which_are_picked_in_its_order() -> None:
    x = planted(10, 5000, 12)
    for which in ([3, 0, 9], [5, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0], []):
        index = torch.tensor(which, dtype=torch.int64)
        got = native.native_argmax(x, index)
        assert got is not None and torch.equal(got, oracle(x[index]) if which else got[:0])
    for bad in (torch.tensor([10]), torch.tensor([-1]), torch.tensor([0], dtype=torch.int32),
                torch.zeros(1, 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="which"):
            native.native_argmax(x, bad)


@needs_native
def test_the_sampler_takes_it_for_unprocessed_greedy_rows_only(monkeypatch) -> None:
    """With the compiled pick replaced by a marker (lane 7 for every row it is asked for),
    unprocessed greedy rows get the marker, in a batch of their own or beside rows with a
    processor or a temperature; those rows take the scratch path and get their real tokens."""
    x = planted(4, 3000, 4)
    sampler = ShardedSampler(None, 0, 3000, 3000, 3000, 4)
    asked: list[list[int] | None] = []

    def marker(raw: torch.Tensor, which: torch.Tensor | None = None,
               checked: bool = False) -> torch.Tensor:
        asked.append(None if which is None else which.tolist())
        return torch.full((raw.shape[0] if which is None else which.numel(),), 7)

    plain = [RowSampling(seed=0, position=0, temperature=0.0)] * 4
    for change in ({"logit_bias": {5: 1.0}}, {"repetition_penalty": 1.1},
                   {"allowed_token_ids": (1, 2)}, {"bad_words": ((9,),)}, {"temperature": 0.5},
                   {"min_tokens": 3, "min_tokens_ids": (2,)}):
        rows = [RowSampling(seed=0, position=0, **({"temperature": 0.0} | change)), *plain[:3]]
        real = sampler.sample(x, rows, [[1]] * 4, [[1]] * 4).tolist()
        assert real[1:] == oracle(x[1:]).tolist(), change
        monkeypatch.setattr("helios_logprobs.ranks.sampler.sampler.native_argmax", marker)
        picked = sampler.sample(x, rows, [[1]] * 4, [[1]] * 4).tolist()
        monkeypatch.undo()
        assert picked == [real[0], 7, 7, 7] and asked.pop() == [1, 2, 3], change
    monkeypatch.setattr("helios_logprobs.ranks.sampler.sampler.native_argmax", marker)
    assert sampler.sample(x, plain, [[]] * 4, [[]] * 4).tolist() == [7] * 4
    assert asked == [None]
