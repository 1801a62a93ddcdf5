"""generation_config.json's sampling defaults, read as vLLM's --generation-config reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helios_logprobs.runtime.http.protocol.defaults import (
    GenerationConfigError,
    SamplingDefaults,
    load_sampling_defaults,
)

QWEN25_INSTRUCT = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                   "eos_token_id": [151645, 151643], "repetition_penalty": 1.05,
                   "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                   "transformers_version": "4.37.0"}


def write(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_sampling_fields_of_the_model_directory(tmp_path: Path):
    defaults = load_sampling_defaults("auto", write(tmp_path, QWEN25_INSTRUCT))
    assert defaults.overrides() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                    "repetition_penalty": 1.05}
    capped = load_sampling_defaults("auto", write(tmp_path, {"max_new_tokens": 7,
                                                             "min_p": 0.1}))
    assert capped.overrides() == {"min_p": 0.1, "max_tokens": 7}


def test_vllm_and_a_missing_file_give_the_neutral_defaults(tmp_path: Path):
    assert load_sampling_defaults("vllm", write(tmp_path, QWEN25_INSTRUCT)).overrides() == {}
    assert load_sampling_defaults("auto", tmp_path / "empty").overrides() == {}
    assert load_sampling_defaults("auto", write(tmp_path / "ids", {"eos_token_id": 2})
                                  ).overrides() == {}


def test_a_named_directory_replaces_the_models(tmp_path: Path):
    model = write(tmp_path / "model", QWEN25_INSTRUCT)
    other = write(tmp_path / "other", {"temperature": 0.2})
    assert load_sampling_defaults(str(other), model).overrides() == {"temperature": 0.2}
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path / "nowhere"), model)


@pytest.mark.parametrize(("config", "field"), [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
])
def test_a_value_no_request_could_carry_is_a_start_up_error(tmp_path: Path, config, field):
    with pytest.raises(GenerationConfigError, match=f"generation_config.json: {field}"):
        load_sampling_defaults("auto", write(tmp_path, config))


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match="expected a JSON object"):
        load_sampling_defaults("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(GenerationConfigError, match="not JSON"):
        load_sampling_defaults("auto", tmp_path)


def test_defaults_are_checked_when_built():
    with pytest.raises(GenerationConfigError, match="x: top_p"):
        SamplingDefaults(top_p=2.0, source="x")
