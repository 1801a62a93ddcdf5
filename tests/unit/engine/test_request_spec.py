"""request_spec: what the ranks receive of a request's sampling parameters."""

from __future__ import annotations

import logging

import pytest

from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.engine.scheduler import request_spec


@pytest.mark.parametrize(("asked", "sampled"), [
    (0.0, 0.0), (1e-7, 0.01), (0.003, 0.01), (0.0099, 0.01), (0.01, 0.01), (0.7, 0.7),
])
def test_a_positive_temperature_below_vllms_floor_samples_at_it(asked, sampled, caplog):
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 (_MAX_TEMP) with a
    warning, so only 0 is greedy: the ranks get the raised temperature."""
    info = EngineInfo("m", 100, 64, 20, True)
    with caplog.at_level(logging.WARNING, logger="helios_logprobs.runtime.engine"):
        spec = request_spec(info, 0, [5, 6], SamplingParams(max_tokens=2, temperature=asked))
    assert spec.sampling.temperature == sampled
    assert spec.sampling.greedy == (asked == 0)
    assert ("maxed it out to 0.01" in caplog.text) == (asked != sampled)
