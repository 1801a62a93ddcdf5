"""Sort keys: order preservation against Python's own float order, the id tie-break, signed
zero, infinities, and the bit-preserving (high, low) word split used by exchange 2."""

from __future__ import annotations

import math
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helios_logprobs.kernels.sortkeys import (
    EMPTY_KEY,
    bits_to_float,
    float_bits,
    key_ids,
    key_values,
    keys_to_words,
    make_keys,
    ordered_high,
    words_to_keys,
)

FP32 = st.floats(width=32, allow_nan=False)  # includes +-0.0, +-inf, subnormals
IDS = st.integers(min_value=0, max_value=2**31 - 1)
SETTINGS = settings(max_examples=60, deadline=None)


def _keys(values: list[float], ids: list[int]) -> list[int]:
    v = torch.tensor(values, dtype=torch.float32)
    return make_keys(v, torch.tensor(ids, dtype=torch.int64)).tolist()


def _oracle_rank(pairs: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Independent order: value descending (Python floats: -0.0 == 0.0), id ascending."""
    return sorted(pairs, key=lambda p: (-p[0], p[1]))


@SETTINGS
@given(st.lists(st.tuples(FP32, IDS), min_size=1, max_size=40, unique_by=lambda p: p[1]))
def test_key_order_equals_value_desc_id_asc(pairs: list[tuple[float, int]]) -> None:
    keys = _keys([p[0] for p in pairs], [p[1] for p in pairs])
    by_key = [p for _, p in sorted(zip(keys, pairs, strict=True), key=lambda kp: -kp[0])]
    want = _oracle_rank(pairs)
    assert [p[1] for p in by_key] == [p[1] for p in want]


@SETTINGS
@given(FP32, FP32)
def test_high_half_preserves_float_order(a: float, b: float) -> None:
    ha, hb = ordered_high(torch.tensor([a, b], dtype=torch.float32)).tolist()
    assert (ha < hb) == (a < b)
    assert (ha == hb) == (a == b)  # so -0.0 and +0.0 share one high half


def test_signed_zero_ties_break_by_id() -> None:
    keys = _keys([-0.0, 0.0, -0.0], [5, 7, 2])
    assert keys[0] > keys[1]  # same value, id 5 < 7
    assert keys[2] > keys[0]  # same value, id 2 < 5
    assert key_values(torch.tensor(keys)).tolist() == [0.0, 0.0, 0.0]
    assert all(math.copysign(1.0, v) > 0 for v in key_values(torch.tensor(keys)).tolist())


def test_infinities_and_extremes_order() -> None:
    values = [float("inf"), 3.4028235e38, 1.0, 1.4e-45, 0.0, -1.4e-45, -1.0, -3.4e38]
    values.append(float("-inf"))
    keys = _keys(values, list(range(len(values))))
    assert keys == sorted(keys, reverse=True)
    assert len(set(keys)) == len(keys)
    assert min(keys) > EMPTY_KEY  # EMPTY_KEY ranks below -inf with any id
    worst = _keys([float("-inf")], [2**31 - 1])[0]
    assert worst > EMPTY_KEY


def test_nan_is_outside_the_value_order() -> None:
    """NaN has no place in the value order; the reductions never rank it (a NaN lane makes
    the row's normalization NaN and the row reports no alternatives). Its key is still a
    well-defined integer, above +inf for the positive quiet NaN, documented here."""
    nan_key, inf_key = _keys([float("nan"), float("inf")], [0, 0])
    assert nan_key > inf_key


@SETTINGS
@given(st.lists(st.tuples(FP32, IDS), min_size=1, max_size=40))
def test_keys_round_trip_ids_values_and_words(pairs: list[tuple[float, int]]) -> None:
    values = [p[0] for p in pairs]
    ids = [p[1] for p in pairs]
    keys = make_keys(torch.tensor(values, dtype=torch.float32), torch.tensor(ids))
    assert key_ids(keys).tolist() == ids
    got = key_values(keys).tolist()
    assert got == [v + 0.0 for v in values]  # exact, -0.0 normalized
    words = keys_to_words(keys)
    assert words.dtype == torch.int32 and words.shape == (len(pairs) * 2,)
    assert torch.equal(words_to_keys(words), keys)
    # The high word is the order-preserving map, the low word is 0xFFFFFFFF - id.
    assert [w & 0xFFFFFFFF for w in words[1::2].tolist()] == [0xFFFFFFFF - i for i in ids]


def test_empty_key_words_round_trip() -> None:
    keys = torch.tensor([EMPTY_KEY, EMPTY_KEY], dtype=torch.int64).view(1, 2)
    words = keys_to_words(keys)
    assert words.tolist() == [[-(2**31), 0, -(2**31), 0]]
    assert torch.equal(words_to_keys(words), keys)


@SETTINGS
@given(st.lists(FP32, min_size=1, max_size=20))
def test_float_bits_match_struct(values: list[float]) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    want = [struct.unpack("<i", struct.pack("<f", v))[0] for v in values]
    assert float_bits(t).tolist() == want
    assert torch.equal(float_bits(bits_to_float(float_bits(t))), float_bits(t))
