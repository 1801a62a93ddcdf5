"""Batch-invariant mode at TP1: a row's bits do not depend on its batch. Oracles: the same
function applied to the row alone, the model's default path and transformers (values), and
speculation off (the engine's tokens and logprobs, compared with ==)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helios_logprobs.ranks.model import ShardedCausalLM, invariant
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.config import RuntimeConfig
from tests.checkpoints import write_qwen2
from tests.spec_helpers import JOBS, assert_matches_transformers, split_events


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize("linear", [invariant.padded_linear, invariant.tiled_linear])
@pytest.mark.parametrize("shape", [(64, 192), (96, 301), (896, 1000)])
def test_linear_row_is_the_same_bits_in_any_batch(linear, shape):
    width, outputs = shape
    torch.manual_seed(0)
    weight, bias = torch.randn(outputs, width), torch.randn(outputs)
    row = torch.randn(1, width)
    alone = linear(row, weight, bias)[0]
    torch.testing.assert_close(alone, F.linear(row, weight, bias)[0], rtol=1e-5, atol=1e-4)
    for count in (2, 3, 5, 12, 15, 16, 17, 40, 129):
        for place in (0, count // 3, count - 1):
            batch = torch.randn(count, width)
            batch[place] = row[0]
            assert torch.equal(linear(batch, weight, bias)[place], alone), (count, place)


def test_choose_linear_refuses_a_matmul_that_is_not_row_invariant(monkeypatch):
    def noisy(x, weight, bias=None):
        return F.linear(x, weight, bias) + x.shape[0] * 1e-3

    monkeypatch.setattr(invariant, "padded_linear", noisy)
    monkeypatch.setattr(invariant, "tiled_linear", noisy)
    with pytest.raises(invariant.BatchInvarianceError, match=r"\(64, 32\)"):
        invariant.choose_linear([(torch.randn(64, 32), None)])


def _cache(slots=3, length=200, kv_heads=2, head_dim=16):
    torch.manual_seed(1)
    return torch.randn(slots, length, kv_heads, head_dim), torch.randn(slots, length, kv_heads,
                                                                       head_dim)


def _sdpa(q, position, slot, keys, values, groups):
    k = keys[slot, : position + 1].repeat_interleave(groups, dim=1).transpose(0, 1)
    v = values[slot, : position + 1].repeat_interleave(groups, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]


def test_attention_equals_sdpa_and_ignores_the_batch():
    keys, values = _cache()
    values[2, 150:] = float("nan")  # a reused slot's stale lanes past every position used
    torch.manual_seed(2)
    q = torch.randn(4, 16)
    for slot, position in ((0, 0), (1, 63), (1, 64), (2, 149)):
        alone = invariant.attention(q[None], torch.tensor([position]), torch.tensor([slot]),
                                    keys, values, groups=2)[0]
        torch.testing.assert_close(alone, _sdpa(q, position, slot, keys, values, 2),
                                   rtol=1e-5, atol=1e-5)
        for others in ((199, 0), (5, 1), (130, 2)):
            positions = torch.tensor([others[0], position, others[0] // 2])
            slots = torch.tensor([others[1], slot, (others[1] + 1) % 3])
            batch = torch.randn(3, 4, 16)
            batch[1] = q
            got = invariant.attention(batch, positions, slots, keys, values, groups=2)
            assert torch.equal(got[1], alone)


def _logits(model, tokens: list[int], slot: int, extra: list[tuple[int, list[int]]]):
    """Prefill ``tokens`` into ``slot`` (with other slots' tokens in the same forward), then
    return the logits of every row of ``tokens``."""
    ids, positions, slots = list(tokens), list(range(len(tokens))), [slot] * len(tokens)
    for other_slot, other in extra:
        ids += other
        positions += list(range(len(other)))
        slots += [other_slot] * len(other)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return model(as_tensor(ids), as_tensor(positions), as_tensor(slots),
                 torch.arange(len(tokens)))


def test_model_rows_are_the_same_bits_alone_in_a_round_and_in_a_busy_batch(qwen2):
    model = ShardedCausalLM.load(qwen2, batch_invariant=True)
    default = ShardedCausalLM.load(qwen2)
    for m in (model, default):
        m.allocate_cache(3, 128)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    whole = _logits(model, prompt, 0, [])
    busy = _logits(model, prompt, 1, [(0, [9] * 90), (2, [3, 4])])
    assert torch.equal(whole, busy)
    # Decoding the last three tokens one at a time (plain decode) and as one round.
    _logits(model, prompt[:4], 2, [])
    rows = []
    for position in range(4, 7):
        ids = torch.tensor([prompt[position], 11, 12])
        out = model(ids, torch.tensor([position, 95, 100]), torch.tensor([2, 0, 1]),
                    torch.tensor([0]))
        rows.append(out[0])
    assert torch.equal(torch.stack(rows), whole[4:])
    reference = _logits(default, prompt, 0, [])
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-5)


def _run(model_dir, speculative_tokens: int) -> list:
    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=96,
                           speculative_tokens=speculative_tokens, ngram_min=1, ngram_max=3,
                           batch_invariant=True)
    return build_engine(config, load_rank(config, None)).run_offline(JOBS)


def test_speculation_on_and_off_report_identical_bits(qwen2):
    off, on = _run(qwen2, 0), _run(qwen2, 4)
    for (prompt, params), a, b in zip(JOBS, off, on, strict=True):
        (tokens_a, finish_a), (tokens_b, finish_b) = split_events(a), split_events(b)
        assert finish_a == finish_b
        assert [(t.token_id, t.logprob, t.alternatives) for t in tokens_a] == [
            (t.token_id, t.logprob, t.alternatives) for t in tokens_b]
        assert_matches_transformers(qwen2, prompt, tokens_b, params)
