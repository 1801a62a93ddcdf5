"""--logprobs-mode at TP1: the sampler's processed rows reduced by the six-launch driver equal
vLLM's processors applied in its order to the full row and renormalized (float64), the
*_logits modes report the values themselves, and the entropy follows the reported
distribution (tests/processed_cases.py; TP2 and TP4 in tests/distributed)."""

from __future__ import annotations

import math

import pytest
import torch

from helios_logprobs.kernels.layout import LOGPROBS_MODES
from helios_logprobs.ranks.step.config import StepConfig
from tests.checkpoints import write_qwen2
from tests.processed_cases import (
    VOCAB,
    check_modes,
    kept_counts,
    processed_logprob,
    run_modes,
    scenario,
    transformers_rows,
)


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_modes(None, 1, 0)


def test_scenario_is_not_trivial(tp1: dict):
    kept = kept_counts()
    assert kept[0] == VOCAB and kept[4] == 5 and kept[5] == 4 and kept[12] == 5
    assert all(k < VOCAB for k in kept[4:11])


def test_tp1_modes_equal_the_oracle(tp1: dict):
    check_modes(tp1)


def test_tp1_modes_on_transformers_rows(tmp_path):
    """The same processors on transformers' logits of the tiny Qwen2 (its full rows)."""
    base = transformers_rows(write_qwen2(tmp_path / "qwen2"))
    check_modes(run_modes(None, 1, 0, base), base)


def test_sampled_token_reports_its_processed_logprob(tp1: dict):
    out, _ = tp1["processed_logprobs"]
    raw, _ = tp1["raw_logprobs"]
    for i in range(len(scenario()[1])):
        got = float(out[i, 1:2].view(torch.float32))
        assert math.isclose(got, processed_logprob(i), abs_tol=1e-5), i
        if i in (4, 7):  # temperature 1, a filter dropped mass: above the raw value
            assert got > float(raw[i, 1:2].view(torch.float32)), i


def test_masked_alternatives_report_minus_inf(tp1: dict):
    out, _ = tp1["processed_logprobs"]
    values = out[5, 3::2].view(torch.float32)[:20]
    assert torch.isfinite(values[:4]).all() and values[4:].eq(float("-inf")).all()
    assert out[5, 2::2][:20].tolist()[:4] == [10, 160, 230, 299]


def test_processed_entropy_is_below_raw_for_filtered_rows(tp1: dict):
    _, processed = tp1["processed_logprobs"]
    _, raw = tp1["raw_logprobs"]
    assert torch.equal(processed, tp1["processed_logits"][1])
    assert float(processed[5]) < float(raw[5]) and float(processed[12]) < float(raw[12])


def test_step_config_checks_the_mode():
    assert StepConfig(4, 64).logprobs_mode == LOGPROBS_MODES[0]
    config = StepConfig(4, 64, logprobs_mode="processed_logits")
    assert config.processed and not config.normalized
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        StepConfig(4, 64, logprobs_mode="processed")
    with pytest.raises(ValueError, match="compile serves"):
        StepConfig(4, 64, compile=True, logprobs_mode="raw_logits")


@pytest.mark.parametrize("normalize", [True, False])
def test_prompt_rows_report_logits_under_the_logits_modes(normalize: bool):
    """Prompt scoring follows vLLM: logits under *_logits, logprobs otherwise (no processor:
    prompt positions are never sampled)."""
    from helios_logprobs.kernels.layout import PROMPT_K, PROMPT_ROW_WORDS
    from helios_logprobs.kernels.scoring.driver import PreparedPromptScoring

    x, _, _, _ = scenario()
    x = x[:6].contiguous()
    targets = torch.tensor([3, 150, 300, 0, -1, 151], dtype=torch.int32)
    scoring = PreparedPromptScoring(None, VOCAB, 0, VOCAB, VOCAB, normalize=normalize)
    out = scoring(x, targets, torch.zeros(6, PROMPT_ROW_WORDS, dtype=torch.int32))
    want = x.to(torch.float64)
    if normalize:
        want = want - torch.logsumexp(want, 1, keepdim=True)
    for r, t in enumerate(targets.tolist()):
        if t < 0:
            assert int(out[r, 0]) == -1
            continue
        value = float(out[r, 1:2].view(torch.float32))
        if normalize:
            assert abs(value - float(want[r, t])) < 1e-5
        else:
            assert value == float(x[r, t])  # bit for bit
        assert int(out[r, 2]) == int((x[r] > x[r, t]).sum()) + 1
        ids = out[r, 3::2][:PROMPT_K].tolist()
        assert ids == sorted(range(VOCAB), key=lambda j: (-float(x[r, j]), j))[:PROMPT_K]
        if not normalize:
            assert torch.equal(out[r, 4::2][:PROMPT_K].view(torch.float32), x[r, ids])
