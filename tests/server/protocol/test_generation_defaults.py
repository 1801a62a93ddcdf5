"""The model's generation_config.json fills the sampling fields a request leaves unset, and its
max_new_tokens caps max_tokens, as vLLM's default `--generation-config auto` does; `vllm`
keeps the neutral defaults. Checked on the SamplingParams each request reaches the engine with.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from helios_logprobs.runtime.http.protocol.defaults import GenerationConfigError
from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import Finished, GeneratedToken
from tests.server.helpers import strict_json
from tests.server.scripted_engine import ScriptedEngine

MODEL_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                  "min_p": 0.05, "repetition_penalty": 1.05, "max_new_tokens": 5,
                  "eos_token_id": 0}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
           "repetition_penalty": 1.0}
FROM_FILE = {k: v for k, v in MODEL_DEFAULTS.items() if k in NEUTRAL}
ROUTES = {"completions": ("/v1/completions", {"prompt": [5, 6]}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})}


@pytest.fixture(scope="module")
def model_dir(model_dirs, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("generation-defaults") / "model"
    shutil.copytree(model_dirs["byte_level"], target)
    (target / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return target


def serve(model_dir: Path, generation_config: str = "auto"):
    engine = ScriptedEngine([GeneratedToken(0, 70, None), Finished("length")])
    return engine, create_app(engine, model_dir, "scripted", generation_config=generation_config)


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def sampling(params) -> dict:
    return {name: getattr(params, name) for name in NEUTRAL}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_unset_fields_take_the_models_defaults(model_dir, route):
    engine, app = serve(model_dir)
    path, body = ROUTES[route]
    assert post(app, path, body).status_code == 200
    assert sampling(engine.params[-1]) == FROM_FILE
    assert engine.params[-1].max_tokens == MODEL_DEFAULTS["max_new_tokens"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fields_the_request_sets_win_and_max_new_tokens_caps_max_tokens(model_dir, route):
    engine, app = serve(model_dir)
    path, body = ROUTES[route]
    mine = {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "min_p": 0.0,
            "repetition_penalty": 1.0}
    assert post(app, path, {**body, **mine, "max_tokens": 3}).status_code == 200
    assert sampling(engine.params[-1]) == mine and engine.params[-1].max_tokens == 3
    assert post(app, path, {**body, "temperature": 0.3, "max_tokens": 40}).status_code == 200
    assert sampling(engine.params[-1]) == {**FROM_FILE, "temperature": 0.3}
    assert engine.params[-1].max_tokens == MODEL_DEFAULTS["max_new_tokens"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_generation_config_vllm_keeps_the_neutral_defaults(model_dir, route):
    engine, app = serve(model_dir, "vllm")
    path, body = ROUTES[route]
    assert post(app, path, body).status_code == 200
    assert sampling(engine.params[-1]) == NEUTRAL
    room = engine.info.max_model_len - len(engine.prompt_ids[-1])
    assert engine.params[-1].max_tokens == (16 if route == "completions" else room)


def test_n_with_the_models_temperature_is_sampling_and_with_a_greedy_one_is_refused(
        model_dir, tmp_path):
    engine, app = serve(model_dir)
    body = {"prompt": [5, 6], "n": 2}
    assert post(app, "/v1/completions", body).status_code == 200
    assert [p.temperature for p in engine.params] == [0.6, 0.6]
    greedy = tmp_path / "greedy"
    shutil.copytree(model_dir, greedy)
    (greedy / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    _, app = serve(greedy)
    response = post(app, "/v1/completions", body)
    assert response.status_code == 400
    error = strict_json(response.content)["error"]
    assert error["param"] == "n" and "greedy sampling" in error["message"]


def test_responses_report_the_sampling_they_ran_with(model_dir):
    engine, app = serve(model_dir)
    response = post(app, "/v1/responses", {"input": "Hi", "top_p": 0.5})
    assert response.status_code == 200, response.text
    body = strict_json(response.content)
    assert (body["temperature"], body["top_p"]) == (0.6, 0.5)
    assert engine.params[-1].top_p == 0.5
    # A temperature below vLLM's floor is reported as the 0.01 it samples with, as vLLM's
    # response (built from its SamplingParams) reports it.
    response = post(app, "/v1/responses", {"input": "Hi", "temperature": 0.004})
    assert strict_json(response.content)["temperature"] == 0.01


def test_an_invalid_generation_config_stops_the_server_at_start_up(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(GenerationConfigError, match="generation_config.json: top_p 0"):
        serve(broken)
