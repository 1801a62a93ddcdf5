"""Triton reductions (kernels/triton/backend.py, kernels/triton/sharded.py) against the
reference, on CPU through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported when no GPU is present), or compiled on the GPU where the process
has one and no interpreter (tests/devices.py; scripts/device-check.sh runs it so).

The cases and both comparisons (bit-exact given the kernel's own lse, and within tolerance of
the independent reference) live in tests/reduction_cases.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.kernels.reference import reduce_reference
from helios_logprobs.kernels.rows import RowRequest
from helios_logprobs.kernels.sortkeys import EMPTY_KEY, float_bits, keys_to_words, make_keys
from helios_logprobs.kernels.triton.backend import (
    PreparedReduction,
    prepared_reduction,
    reduce_triton,
)
from helios_logprobs.kernels.triton.common import (
    SELECT_EXTRACT,
    SELECT_RANK,
    SELECT_TOPK,
    key_high_word,
    key_low_word,
    key_token_id,
    key_value_bits,
    sort_key,
    words_to_key,
)
from helios_logprobs.kernels.triton.sharded import PreparedShardedReduction
from tests.reduction_cases import (
    ATOL,
    DEVICE,
    INF,
    NAN,
    assert_matches_reference,
    exact_expected,
    first_difference,
    pack,
    random_case,
    run_prepared,
    sentinel_out,
    simulate_world,
    to_device,
    values_with_lse,
)

ROOT = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def check_single(logits, chosen, token_ids, requested, k, vocab, prepared=None):
    rows, width = logits.shape
    if prepared is None:
        prepared = prepared_reduction(rows, width, logits.dtype, DEVICE)
    out, base, lse = run_prepared(prepared, logits, chosen, token_ids, requested, k, vocab)
    expected = exact_expected(logits, chosen, token_ids, requested, k, vocab, lse, base)
    assert torch.equal(out, expected), first_difference(out, expected)
    assert_matches_reference(out, logits, chosen, token_ids, requested, k, vocab, base)
    live = requested != 0
    ref_lse = torch.logsumexp(logits[:, :vocab].to(torch.float32), dim=-1)
    finite = live & torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=ATOL, rtol=0)
    return out, base, lse


# --------------------------------------------------------------------------------------------
# Sort keys in Triton are bit-identical to kernels.sortkeys
# --------------------------------------------------------------------------------------------


@triton.jit
def _keys_probe_kernel(values_ptr, ids_ptr, keys_ptr, words_ptr, back_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(values_ptr + offs)
    i = tl.load(ids_ptr + offs)
    key = sort_key(v, i)
    tl.store(keys_ptr + offs, key)
    high = key_high_word(key)
    low = key_low_word(key)
    tl.store(words_ptr + 2 * offs, high)
    tl.store(words_ptr + 2 * offs + 1, low)
    again = words_to_key(high, low)
    tl.store(back_ptr + 3 * offs, again)
    tl.store(back_ptr + 3 * offs + 1, key_token_id(again))
    tl.store(back_ptr + 3 * offs + 2, key_value_bits(again).to(tl.int64))


def test_sort_keys_match_sortkeys_module():
    specials = [0.0, -0.0, 1.0, -1.0, INF, -INF, 1e-45, -1e-45, 3.4e38, -3.4e38, -0.5, 0.5]
    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.tensor(specials), torch.randn(64 - len(specials), generator=g)])
    values = torch.cat([values, torch.tensor([NAN])]).to(torch.float32)
    values = torch.cat([values, torch.zeros(128 - values.numel())])
    ids = torch.randint(0, 2**31 - 1, (128,), generator=g, dtype=torch.int64)
    ids[:4] = torch.tensor([0, 1, 151935, 2**31 - 1])
    keys, words, back = to_device(torch.empty(128, dtype=torch.int64),
                                  torch.empty(256, dtype=torch.int32),
                                  torch.empty(384, dtype=torch.int64))
    _keys_probe_kernel[(1,)](*to_device(values, ids), keys, words, back, BLOCK=128)
    keys, words, back = keys.cpu(), words.cpu(), back.cpu()
    expected = make_keys(values, ids)
    assert torch.equal(keys, expected)
    assert torch.equal(words, keys_to_words(expected))
    back = back.view(128, 3)
    assert torch.equal(back[:, 0], expected)
    assert torch.equal(back[:, 1], ids)
    normalized = torch.where(values == 0, torch.zeros_like(values), values)
    assert torch.equal(back[:, 2].to(torch.int32), float_bits(normalized))
    # Larger key = better: order by (value desc, id asc), and -0.0 ties with +0.0.
    assert int(make_keys(torch.tensor([-0.0]), torch.tensor([3]))) == int(
        make_keys(torch.tensor([0.0]), torch.tensor([3]))
    )
    assert EMPTY_KEY < int(expected.min())


# --------------------------------------------------------------------------------------------
# Single rank: odd shapes, dtypes, flags, selected IDs, padding garbage
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 423])
@pytest.mark.parametrize("rows", [1, 37])
def test_odd_shapes_fp32(rows: int, vocab: int):
    width = vocab + (0 if vocab == 1 else 5)
    logits, chosen, token_ids, requested = random_case(rows, vocab, width, torch.float32, vocab)
    check_single(logits, chosen, token_ids, requested, 20, vocab)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(37, 423), (1, 7)])
def test_half_dtypes(rows: int, vocab: int, dtype: torch.dtype):
    logits, chosen, token_ids, requested = random_case(rows, vocab, vocab + 9, dtype, rows)
    check_single(logits, chosen, token_ids, requested, 20, vocab)


def test_vocab_32000_bf16_default_prepared():
    logits, chosen, token_ids, requested = random_case(
        2, 32000, 32000, torch.bfloat16, 7, flags=False, selected=False
    )
    check_single(logits, chosen, token_ids, requested, 20, 32000)


def test_vocab_32000_fp32_strided_rows_and_selection():
    # Row stride 32,768 != width 32,000: a prefix view of a wider buffer (the lanes past the
    # view hold garbage that must never be read).
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3, 32768, generator=g) * 4
    big[:, 32000:] = NAN
    logits = big[:, :32000]
    assert logits.stride(0) == 32768
    chosen = torch.tensor([5, 31999, 17], dtype=torch.int32)
    requested = torch.tensor([1, 1, 0], dtype=torch.int32)
    order = torch.argsort(logits[1], descending=True)
    token_ids = [[], order[-MAX_TOKEN_IDS:].flip(0).tolist(), [1, 2]]
    check_single(logits, chosen, token_ids, requested, 20, 32000)


@pytest.mark.parametrize("select", [SELECT_EXTRACT, SELECT_TOPK, SELECT_RANK])
def test_selection_networks_multi_tile(select: int):
    # Small tiles and merge blocks exercise every loop: 7 tiles per row, the merge in chunks.
    logits, chosen, token_ids, requested = random_case(3, 423, 448, torch.float32, 11)
    prepared = PreparedReduction(3, 448, torch.float32, DEVICE, block_size=64,
                                 merge_block=64, select=select)
    check_single(logits, chosen, token_ids, requested, 20, 423, prepared)


def test_many_tiles_small_merge_block():
    logits, chosen, token_ids, requested = random_case(5, 1000, 1030, torch.float16, 12)
    prepared = PreparedReduction(8, 1030, torch.float16, DEVICE, block_size=32, merge_block=32)
    check_single(logits, chosen, token_ids, requested, 20, 1000, prepared)


# --------------------------------------------------------------------------------------------
# Ties, signed zeros, infinities, NaN
# --------------------------------------------------------------------------------------------


def test_exact_ties_pick_smallest_ids_across_tiles():
    # Only four distinct logit values over 423 lanes: the top-20 is decided by the id rule,
    # and the tied ids are spread over every tile.
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 4, (4, 423), generator=g).to(torch.float32)
    logits[1] = 2.5  # a whole row of equal logits
    chosen = torch.tensor([0, 422, 7, 100], dtype=torch.int32)
    requested = torch.ones(4, dtype=torch.int32)
    prepared = PreparedReduction(4, 423, torch.float32, DEVICE, block_size=64, merge_block=64)
    out, _, _ = check_single(logits, chosen, None, requested, 20, 423, prepared)
    assert out[1, 2:42:2].tolist() == list(range(20))
    ref = reduce_reference(logits, chosen, k=20, token_ids=None, vocab_size=423,
                           requested=requested, out=sentinel_out(4))
    assert torch.equal(out[:, ::2], ref[:, ::2])


def test_ties_created_by_subtraction():
    # Logits that differ by less than half an ulp of (x - lse) collapse onto one reported
    # value: the larger raw logit must NOT win; the smaller id does.
    vocab = 300
    logits = torch.full((2, vocab), -50.0)
    lanes = torch.tensor([250, 3, 199, 64, 120, 77, 5, 290])
    tiny = torch.arange(8, 0, -1, dtype=torch.float32) * 2.0**-22  # larger logit, larger id
    logits[:, lanes] = tiny
    logits[:, 42] = 40.0  # dominates lse ~ 40: ulp(40) = 2**-18 >> 8 * 2**-22
    chosen = torch.tensor([250, 42], dtype=torch.int32)
    requested = torch.ones(2, dtype=torch.int32)
    prepared = PreparedReduction(2, vocab, torch.float32, DEVICE, block_size=64, merge_block=32)
    out, _, lse = check_single(logits, chosen, None, requested, 20, vocab, prepared)
    values = values_with_lse(logits, vocab, lse)
    assert bool((values[0, lanes] == values[0, lanes[0]]).all()), "test setup: no tie"
    assert len(set(logits[0, lanes].tolist())) == 8, "test setup: raw logits must differ"
    assert out[0, 2] == 42
    assert out[0, 4:20:2].tolist() == sorted(lanes.tolist())


def test_signed_zeros():
    # +0.0 and -0.0 logits are equal: smaller id first. A value of exactly zero (vocab 1,
    # logit -0.0: lse = +0.0, value = -0.0) keeps its sign in the chosen pair.
    logits = torch.zeros(3, 40)
    logits[0, 0::3] = -0.0
    logits[0, 1::3] = 0.0
    logits[0, 2::3] = -1.0
    logits[1, :] = -0.0
    chosen = torch.tensor([3, 0, 0], dtype=torch.int32)
    requested = torch.ones(3, dtype=torch.int32)
    out, _, _ = check_single(logits, chosen, None, requested, 20, 40)
    ranked = [i for i in range(40) if i % 3 != 2][:20]
    assert out[0, 2:42:2].tolist() == ranked
    one = torch.tensor([[-0.0, 7.0]])
    out1, _, _ = check_single(one, torch.tensor([0], dtype=torch.int32), None,
                              torch.ones(1, dtype=torch.int32), 20, 1)
    assert int(out1[0, 1]) == int(float_bits(torch.tensor([-0.0]))[0])  # chosen: -0.0
    assert out1[0, 2:4].tolist() == [0, 0]  # alternative: id 0, +0.0 (normalized)
    assert out1[0, 4:].eq(-1).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf, log(0)
def test_infinities_and_nan():
    rows, vocab = 6, 50
    logits = torch.randn(rows, vocab + 6)
    logits[:, vocab:] = INF  # padding garbage never enters
    logits[0, 10:30] = -INF  # -inf entries rank last, by id
    logits[1, :vocab] = -INF  # every logit -inf: non-finite lse
    logits[2, 17] = NAN
    logits[3, 33] = INF
    logits[4, 0] = -INF
    logits[5, :] = 0.0
    logits[5, vocab:] = NAN
    chosen = torch.tensor([12, 3, 17, 33, 0, 49], dtype=torch.int32)
    requested = torch.ones(rows, dtype=torch.int32)
    token_ids = [[], [], [], [], [], []]
    token_ids[4] = [0, 1, 49]
    prepared = PreparedReduction(rows, vocab + 6, torch.float32, DEVICE, block_size=32)
    out, _, _ = check_single(logits, chosen, token_ids, requested, 20, vocab, prepared)
    nan_bits = int(float_bits(torch.tensor([NAN]))[0])
    for row in (1, 2, 3):
        assert int(out[row, 1]) == nan_bits
        assert out[row, 3:42:2].eq(nan_bits).all()
        assert out[row, 2:42:2].tolist() == list(range(20))
    assert int(out[4, 3]) == int(float_bits(torch.tensor([-INF]))[0])
    vocab7 = torch.tensor([[-INF, 1.0, -INF, 2.0, 0.0, -INF, 1.0]])
    out7, _, _ = check_single(vocab7, torch.tensor([0], dtype=torch.int32), None,
                              torch.ones(1, dtype=torch.int32), 20, 7)
    assert out7[0, 2:16:2].tolist() == [3, 1, 6, 4, 0, 2, 5]


# --------------------------------------------------------------------------------------------
# Flags, K, selected IDs, small vocabularies
# --------------------------------------------------------------------------------------------


def test_zero_flags_leave_rows_untouched():
    logits, chosen, token_ids, _ = random_case(6, 100, 100, torch.float32, 21)
    requested = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.int32)
    out, base, _ = check_single(logits, chosen, token_ids, requested, 20, 100)
    for row in (0, 2, 3, 5):
        assert torch.equal(out[row], base[row])
    none = torch.zeros(6, dtype=torch.int32)
    out2, base2, _ = check_single(logits, chosen, token_ids, none, 20, 100)
    assert torch.equal(out2, base2)


def test_bool_and_int64_flags_and_int64_chosen():
    logits, chosen, token_ids, requested = random_case(4, 60, 64, torch.float32, 22)
    prepared = prepared_reduction(4, 64, torch.float32, DEVICE)
    # The int32 call checked against the oracles (bit-exact given its lse, and the reference).
    expected, _, _ = check_single(logits, chosen, token_ids, requested, 20, 60, prepared)
    expected = expected.to(DEVICE)
    ids, counts = pack(token_ids, 4)
    logits, chosen, ids, counts, requested = to_device(logits, chosen, ids, counts, requested)
    for flags, chosen_as in ((requested.bool(), chosen.long()), (requested.long(), chosen)):
        out = sentinel_out(4).to(DEVICE)
        prepared(logits, chosen_as, ids, counts, flags, 20, 60, out)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_k_values(k: int):
    logits, chosen, token_ids, requested = random_case(5, 120, 128, torch.float32, 30 + k)
    check_single(logits, chosen, token_ids, requested, k, 120)


def test_vocab_smaller_than_k():
    logits = torch.randn(3, 16)
    logits[:, 7:] = NAN
    chosen = torch.tensor([0, 6, 3], dtype=torch.int32)
    requested = torch.ones(3, dtype=torch.int32)
    out, _, _ = check_single(logits, chosen, None, requested, 20, 7)
    assert out[:, 2 + 2 * 7 :].eq(-1).all()
    assert sorted(out[0, 2:16:2].tolist()) == list(range(7))


def test_selected_ids_caller_order_outside_top_k():
    vocab = 423
    g = torch.Generator().manual_seed(40)
    logits = torch.randn(3, vocab, generator=g)
    order = torch.argsort(logits[0], descending=True).tolist()
    chosen = torch.tensor([order[0], order[5], 1], dtype=torch.int32)
    low = order[-7:]  # the seven worst ids, in a scrambled caller order
    token_ids = [[low[3], low[0], low[6], low[1], low[5], low[2], low[4]], [order[100]], []]
    token_ids[2] = torch.randperm(vocab, generator=g)[:MAX_TOKEN_IDS].tolist()
    requested = torch.ones(3, dtype=torch.int32)
    prepared = PreparedReduction(3, vocab, torch.float32, DEVICE, block_size=128)
    out, _, _ = check_single(logits, chosen, token_ids, requested, 20, vocab, prepared)
    assert out[0, 2:16:2].tolist() == token_ids[0]
    assert int(out[0, 0]) == order[0] and order[0] not in token_ids[0]
    assert out[0, 16:].eq(-1).all()
    assert out[1, 2] == order[100] and out[1, 4:].eq(-1).all()
    assert out[2, 2::2].tolist() == token_ids[2]


def test_strided_views_of_frame_buffers():
    # The payload of one token position t of a [rows, T, 258] frame (row stride T * 258,
    # base offset t * 258 words, not 16-byte aligned for odd t) and flag/id/count/chosen
    # vectors that are row-offset views of capacity-sized buffers.
    rows, t_slots, vocab = 5, 3, 200
    logits, chosen, token_ids, requested = random_case(rows, vocab, vocab, torch.float32, 45)
    ids, counts = pack(token_ids, rows)
    frame = torch.stack([sentinel_out(rows)] * t_slots, dim=1).to(DEVICE)
    cap_req = torch.zeros(rows + 3, dtype=torch.int32)
    cap_req[1 : rows + 1] = requested
    cap_chosen = torch.zeros(rows + 3, dtype=torch.int32)
    cap_chosen[1 : rows + 1] = chosen
    cap_ids = torch.full((rows + 3, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    cap_ids[1 : rows + 1] = ids
    cap_counts = torch.zeros(rows + 3, dtype=torch.int32)
    cap_counts[1 : rows + 1] = counts
    dev_logits, cap_req, cap_chosen, cap_ids, cap_counts = to_device(
        logits, cap_req, cap_chosen, cap_ids, cap_counts
    )
    prepared = prepared_reduction(rows, vocab, torch.float32, DEVICE)
    out = frame[:, 1]
    assert out.stride(0) == t_slots * PAYLOAD_WORDS
    prepared(dev_logits, cap_chosen[1 : rows + 1], cap_ids[1 : rows + 1],
             cap_counts[1 : rows + 1], cap_req[1 : rows + 1], 20, vocab, out)
    frame = frame.cpu()
    expected = exact_expected(logits, chosen, token_ids, requested, 20, vocab,
                              prepared.lse[:rows].cpu(), sentinel_out(rows))
    assert torch.equal(frame[:, 1], expected), first_difference(frame[:, 1], expected)
    assert torch.equal(frame[:, 0], sentinel_out(rows))
    assert torch.equal(frame[:, 2], sentinel_out(rows))


def test_prepared_reduction_reuses_its_workspaces():
    prepared = prepared_reduction(4, 96, torch.float32, DEVICE)
    assert prepared_reduction(3, 96, torch.float32, DEVICE) is prepared
    ptrs = [t.data_ptr() for t in (prepared.tile_max, prepared.tile_mass, prepared.lse,
                                   prepared.cand)]
    logits, chosen, token_ids, requested = random_case(4, 90, 96, torch.float32, 50)
    ids, counts = pack(token_ids, 4)
    logits, chosen, ids, counts, requested = to_device(logits, chosen, ids, counts, requested)
    out = sentinel_out(4).to(DEVICE)
    request = RowRequest(chosen, ids, counts, requested, 20)
    reduce_triton(logits, request, 90, out)
    reduce_triton(logits, request, 90, out)
    assert prepared_reduction(4, 96, torch.float32, DEVICE) is prepared
    assert ptrs == [t.data_ptr() for t in (prepared.tile_max, prepared.tile_mass,
                                           prepared.lse, prepared.cand)]


def test_launcher_checks():
    prepared = PreparedReduction(4, 64, torch.float32, DEVICE, warmup=False)
    ids, counts = pack(None, 4)
    logits, chosen, requested, ids, counts, out = to_device(
        torch.randn(4, 64), torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
        ids, counts, sentinel_out(4),
    )
    ok = dict(logits=logits, chosen=chosen, ids=ids, counts=counts, requested=requested, k=20,
              vocab_size=64, out=out)
    bad = [
        dict(logits=torch.randn(4, 64).to(torch.float64)),
        dict(logits=torch.randn(64, 4).t()),
        dict(logits=torch.randn(5, 64)),
        dict(logits=torch.randn(4, 63)),
        dict(chosen=torch.zeros(4, dtype=torch.float32)),
        dict(chosen=torch.zeros(3, dtype=torch.int32)),
        dict(ids=ids.long()),
        dict(ids=ids[:, :64]),
        dict(counts=counts.long()),
        dict(requested=requested.float()),
        dict(k=33),
        dict(vocab_size=65),
        dict(vocab_size=0),
        dict(out=out[:, :200]),
        dict(out=out.long()),
        dict(ids=None),
    ]
    for change in bad:
        args = {**ok, **change}
        with pytest.raises(ValueError):
            prepared(**args)
    with pytest.raises(ValueError):
        PreparedReduction(4, 64, torch.float32, DEVICE, block_size=48, warmup=False)


# --------------------------------------------------------------------------------------------
# Sharded step functions, world simulated in one process
# --------------------------------------------------------------------------------------------


def check_sharded(logits, starts, width, chosen, token_ids, requested, k, **kw):
    outs, lses, e1_all, e2_all = simulate_world(
        logits, starts, width, chosen, token_ids, requested, k, **kw
    )
    vocab = starts[-1]
    base = sentinel_out(logits.shape[0])
    live = requested != 0
    for r in range(1, len(outs)):
        assert torch.equal(outs[r], outs[0]), f"rank {r} payload differs from rank 0"
        assert torch.equal(lses[r][live].view(torch.int32), lses[0][live].view(torch.int32))
    expected = exact_expected(logits, chosen, token_ids, requested, k, vocab, lses[0], base)
    assert torch.equal(outs[0], expected), first_difference(outs[0], expected)
    assert_matches_reference(outs[0], logits, chosen, token_ids, requested, k, vocab, base)
    # Unflagged rows of both exchanges were never written.
    assert e1_all[:, ~live].eq(77).all() and e2_all[:, ~live].eq(77).all()
    assert all(torch.equal(o[~live], base[~live]) for o in outs)
    return outs[0], lses[0], e1_all, e2_all


@pytest.mark.parametrize(
    "starts",
    [[0, 212, 423], [0, 100, 100, 423], [0, 141, 282, 423], [0, 106, 212, 318, 423]],
    ids=["tp2", "tp3-empty-shard", "tp3", "tp4"],
)
def test_sharded_simulated_world(starts: list[int]):
    width = max(b - a for a, b in zip(starts, starts[1:], strict=False)) + 3
    logits, chosen, token_ids, requested = random_case(9, 423, 423, torch.float32, 60,
                                                       garbage=False)
    prepared = PreparedShardedReduction(9, width, torch.float32, DEVICE, block_size=64,
                                        merge_block=64)
    check_sharded(logits, starts, width, chosen, token_ids, requested, 20, prepared=prepared)


def test_sharded_module_functions_bf16_32000_tp4():
    logits, chosen, token_ids, requested = random_case(2, 32000, 32000, torch.bfloat16, 61,
                                                       flags=False, garbage=False)
    token_ids = [[], [31999, 0, 8000, 8001, 16000, 24000, 5]]
    chosen = torch.tensor([8000, 24001], dtype=torch.int32)
    check_sharded(logits, [0, 8000, 16000, 24000, 32000], 8000, chosen, token_ids, requested,
                  20, starts_as_tensor=True)


def test_sharded_exchange_word_layouts():
    vocab, starts, width = 150, [0, 0, 80, 150], 96  # rank 0 holds no vocabulary
    g = torch.Generator().manual_seed(62)
    logits = torch.randn(3, vocab, generator=g) * 2
    logits[0, 81] = logits[0, 82]  # an exact tie across no tile boundary
    chosen = torch.tensor([100, 5, 79], dtype=torch.int32)
    requested = torch.tensor([1, 1, 0], dtype=torch.int32)
    token_ids = [[], [149, 0, 80, 79], []]
    prepared = PreparedShardedReduction(3, width, torch.float32, DEVICE, block_size=32,
                                        merge_block=32)
    out, lse, e1_all, e2_all = check_sharded(logits, starts, width, chosen, token_ids,
                                             requested, 20, prepared=prepared)
    neg_inf = int(float_bits(torch.tensor([-INF]))[0])
    # Exchange 1: the empty shard reports (-inf, 0); others (max, mass) bits. Word 2 (the
    # entropy term, kernels/entropy.py) is never written by the statistics launches.
    assert e1_all[0, :2, :2].tolist() == [[neg_inf, 0], [neg_inf, 0]]
    assert (e1_all[:, :, 2] == 77).all()
    for r in (1, 2):
        part = logits[:2, starts[r] : starts[r + 1]]
        m = part.max(dim=1).values
        s = torch.exp(part - m[:, None]).sum(dim=1)
        assert torch.equal(e1_all[r, :2, 0], float_bits(m))
        torch.testing.assert_close(e1_all[r, :2, 1].view(torch.float32), s, rtol=1e-6, atol=0)
    # Exchange 2, natural row 0: word 0 = chosen raw bits at its owner (rank 2), else 0;
    # words 1..64 = the shard's best 32 keys as (high, low) words; 65..128 = 0.
    values = values_with_lse(logits, vocab, lse)
    for r in range(3):
        lo, hi = starts[r], starts[r + 1]
        owner = lo <= 100 < hi
        assert int(e2_all[r, 0, 0]) == (int(float_bits(logits[0, 100:101])[0]) if owner else 0)
        keys = make_keys(values[0, lo:hi], torch.arange(lo, hi))
        top = torch.sort(keys, descending=True).values[:32]
        top = torch.cat([top, torch.full((32 - top.numel(),), EMPTY_KEY, dtype=torch.int64)])
        assert torch.equal(e2_all[r, 0, 1:65], keys_to_words(top))
        assert e2_all[r, 0, 65:].eq(0).all()
    # Exchange 2, selected row 1: word 1 + j = raw bits of ids[j] at its owner, else 0.
    for r in range(3):
        lo, hi = starts[r], starts[r + 1]
        for j, t in enumerate(token_ids[1]):
            want = int(float_bits(logits[1, t : t + 1])[0]) if lo <= t < hi else 0
            assert int(e2_all[r, 1, 1 + j]) == want
        assert e2_all[r, 1, 1 + len(token_ids[1]) :].eq(0).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf, log(0)
def test_sharded_non_finite_and_vocab_below_k():
    vocab, starts, width = 12, [0, 5, 12], 8
    logits = torch.randn(4, vocab)
    logits[0, 9] = NAN  # NaN on rank 1 only: every rank reports NaN
    logits[1, :] = -INF
    logits[2, 2] = INF
    chosen = torch.tensor([9, 0, 2, 11], dtype=torch.int32)
    requested = torch.ones(4, dtype=torch.int32)
    out, lse, _, _ = check_sharded(logits, starts, width, chosen, None, requested, 20)
    assert not torch.isfinite(lse[:3]).any()
    assert out[3, 2 + 2 * vocab :].eq(-1).all()
    assert sorted(out[3, 2 : 2 + 2 * vocab : 2].tolist()) == list(range(vocab))


def test_sharded_matches_single_rank_triton():
    logits, chosen, token_ids, requested = random_case(5, 423, 423, torch.float16, 63,
                                                       garbage=False)
    single = PreparedReduction(5, 423, torch.float16, DEVICE, block_size=64)
    # Each against the independent checks first; then the two Triton paths with each other.
    out1, _, lse1 = check_single(logits, chosen, token_ids, requested, 20, 423, single)
    out2, lse2, _, _ = check_sharded(logits, [0, 200, 423], 223, chosen, token_ids,
                                     requested, 20)
    live = requested != 0
    assert torch.equal(out2[:, ::2], out1[:, ::2])
    torch.testing.assert_close(lse2[live], lse1[live], atol=2e-6, rtol=0)
    torch.testing.assert_close(out2[live, 1::2].view(torch.float32),
                               out1[live, 1::2].view(torch.float32), atol=2e-6, rtol=0,
                               equal_nan=True)


# --------------------------------------------------------------------------------------------
# The kernels also compile for a Hopper GPU (no GPU needed: Triton's bundled ptxas)
# --------------------------------------------------------------------------------------------


SM90_SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from helios_logprobs.kernels.triton import backend as B, common as C, sharded as S

    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")

    def sig(fn, types, consts):
        return {n: "constexpr" if n in consts else types.get(n, "i64") for n in fn.arg_names}

    report = {}
    def build(fn, types, consts, warps=4):
        src = ASTSource(fn, sig(fn, types, consts), consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        usage = ""
        if os.path.exists(CUOBJDUMP):
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
            os.unlink(f.name)
        report[fn.__name__] = " ".join(w for w in usage.split() if w.startswith(
            ("REG:", "STACK:", "LOCAL:", "SHARED:")))

    p = lambda t: "*" + t
    ptrs32 = {n: p("i32") for n in ("requested_ptr", "counts_ptr", "ids_ptr", "chosen_ptr",
                                    "out_ptr", "e1_ptr", "e2_ptr")}
    base = dict(ptrs32, logits_ptr=p("bf16"), tile_max_ptr=p("fp32"),
                tile_mass_ptr=p("fp32"), lse_ptr=p("fp32"), cand_ptr=p("i64"),
                starts_ptr=p("i64"))
    sel = C.SELECT_TOPK
    mb = B.GPU_MERGE_BLOCK
    build(C.tile_stats_kernel, base, dict(BLOCK_SIZE=4096), 8)
    build(B._row_lse_kernel, base, dict(BLOCK_TILES=64))
    build(C.tile_keys_kernel, base, dict(BLOCK_SIZE=4096, SELECT=sel), 8)
    build(B._final_merge_kernel, base, dict(MAX_IDS=128, MERGE_BLOCK=mb, SELECT=sel))
    build(S._shard_stats_kernel, base, dict(BLOCK_TILES=64))
    build(S._global_lse_kernel, base, {}, 1)
    build(S._shard_merge_kernel, base, dict(MAX_IDS=128, MERGE_BLOCK=mb, SELECT=sel))
    build(S._sharded_final_kernel, base,
          dict(MAX_IDS=128, MERGE_BLOCK=S.FINAL_MERGE_BLOCK, SELECT=sel))
    print(json.dumps({"cuobjdump": os.path.exists(CUOBJDUMP), "kernels": report}))
    """
)


@pytest.fixture
def sm90_compile():
    """The sm_90 AOT compile (about a minute of ptxas) in a child process, started only where
    its test runs (under pytest-xdist, on that one worker; the other cores run other tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.Popen([sys.executable, "-c", SM90_SCRIPT, str(ROOT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_kernels_compile_for_sm90(sm90_compile):
    """Every kernel as the GPU runs it (tl.topk selection, bf16 logits, 4096-lane tiles)
    compiles for sm_90 without the interpreter, with Triton's bundled ptxas (no GPU needed),
    and uses no local memory (no register spills)."""
    stdout, stderr = sm90_compile.communicate(timeout=270)  # inside the 300 s test timeout
    assert sm90_compile.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    report = result["kernels"]
    assert len(report) == 8, report
    if not result["cuobjdump"]:
        pytest.skip("all 8 kernels compiled for sm_90, but this triton has no cuobjdump to "
                    "read their register, stack and local-memory use")
    for name, usage in report.items():
        # cuobjdump printed nothing for a kernel: fail, never pass without reading it.
        assert re.search(r"REG:\d+", usage), (name, usage)
        assert "LOCAL:0" in usage.split() and "STACK:0" in usage.split(), (name, usage)
