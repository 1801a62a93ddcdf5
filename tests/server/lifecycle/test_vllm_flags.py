"""vLLM's server flags through real servers, driven by the official openai client and httpx.

Two servers of the same checkpoint: ``keyed`` (launch.serve with --api-key, two served names,
CORS for one origin with credentials, --enable-log-requests, vLLM's scheduler names, --seed)
and ``wrapped`` (helios-serve MODEL -tp 1: the positional model, the key from VLLM_API_KEY,
--disable-uvicorn-access-log, the same --seed).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.helpers import Server, launch, strict_json, token_id_of

pytestmark = pytest.mark.slow

KEY, ENV_KEY, SEED = "sk-test-key", "sk-env-key", 11
ORIGIN = "http://app.example"
NAMES = ("alpha", "org/beta")
UNSEEDED = [{"prompt": f"Story {i}:", "max_tokens": 12, "temperature": 2.0,
             "return_tokens_as_token_ids": True, "logprobs": 0} for i in range(3)]


def sampled(server: Server, key: str) -> list[list[int]]:
    """The tokens of UNSEEDED, sent one after another (no seed in any of them)."""
    out = []
    for body in UNSEEDED:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        out.append([token_id_of(t) for t in answer.json()["choices"][0]["logprobs"]["tokens"]])
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dirs):
    """Both servers, and the tokens each sampled for UNSEEDED as its first requests."""
    log_dir = tmp_path_factory.mktemp("vllm-flags")
    model_dir = model_dirs["byte_level"]
    keyed = launch("keyed", model_dir, 1, [
        "--api-key", KEY, "--served-model-name", *NAMES, "--max-num-seqs", "3",
        "--max-num-batched-tokens", "48", "--gpu-memory-utilization", "0.5", "--seed",
        str(SEED), "--enable-log-requests", "--allowed-origins", f'["{ORIGIN}"]',
        "--allow-credentials"], log_dir)

    def wrapper(port: int) -> list[str]:
        return ["-m", "helios_logprobs.launch.wrapper", str(model_dir), "-tp", "1", "--port",
                str(port), "--max-model-len", "256", "--seed", str(SEED),
                "--disable-uvicorn-access-log"]

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_API_KEY", ENV_KEY)
        wrapped = launch("wrapped", model_dir, 1, [], log_dir, command=wrapper)
    try:
        keyed.wait_healthy()
        wrapped.wait_healthy()
        draws = {"keyed": sampled(keyed, KEY), "wrapped": sampled(wrapped, ENV_KEY)}
        yield {"keyed": keyed, "wrapped": wrapped, "draws": draws}
    finally:
        keyed.stop()
        wrapped.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def whole_log(server: Server) -> str:
    return server.log_path.read_text(errors="replace")


def check_error_shape(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = strict_json(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] == status and error["param"] == param, error


def test_the_api_key_guards_v1_and_leaves_the_probes_open(servers):
    server = servers["keyed"]
    with pytest.raises(openai.AuthenticationError) as refused:
        client(server, "not-the-key").models.list()
    assert refused.value.status_code == 401
    assert [m.id for m in client(server, KEY).models.list().data] == list(NAMES)
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}):
        answer = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=30,
                            json={"prompt": "a", "max_tokens": 1})
        check_error_shape(answer, 401, None)
    for path in ("/health", "/ping", "/metrics", "/version"):  # open, as in vLLM
        assert httpx.get(server.url + path, timeout=30).status_code == 200, path


def test_the_api_key_comes_from_vllm_api_key(servers):
    server = servers["wrapped"]
    with pytest.raises(openai.AuthenticationError):
        client(server, KEY).completions.create(model=server.model_dir.name, prompt="a",
                                               max_tokens=1)
    done = client(server, ENV_KEY).completions.create(model=server.model_dir.name, prompt="a",
                                                      max_tokens=1)
    assert done.usage.completion_tokens == 1


def test_every_served_name_is_listed_retrieved_and_accepted(servers):
    api = client(servers["keyed"], KEY)
    for name in NAMES:
        assert api.models.retrieve(name).id == name
        done = api.completions.create(model=name, prompt="a", max_tokens=2)
        assert done.model == NAMES[0]  # responses carry the first name, as vLLM's
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("no-such-model")
    answer = httpx.get(f"{servers['keyed'].url}/v1/models/no-such-model", timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
    check_error_shape(answer, 404, "model")
    assert "no-such-model" in answer.json()["error"]["message"]


def test_a_cors_preflight_is_answered_for_the_allowed_origin_only(servers):
    url = f"{servers['keyed'].url}/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    allowed = httpx.options(url, headers={"Origin": ORIGIN, **ask}, timeout=30)
    assert allowed.status_code == 200, allowed.text  # no key asked for, no 405
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = httpx.options(url, headers={"Origin": "http://elsewhere.example", **ask}, timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # A refused call still carries CORS headers, so the page can read why.
    refused = httpx.get(f"{servers['keyed'].url}/v1/models", headers={"Origin": ORIGIN},
                        timeout=30)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_access_log_and_the_request_log(servers):
    keyed, wrapped = servers["keyed"], servers["wrapped"]
    body = {"prompt": "Logged", "max_tokens": 2}
    httpx.post(f"{keyed.url}/v1/completions", json=body, timeout=60,
               headers={"Authorization": f"Bearer {KEY}"})
    httpx.post(f"{wrapped.url}/v1/completions", json=body, timeout=60,
               headers={"Authorization": f"Bearer {ENV_KEY}"})
    keyed_log, wrapped_log = whole_log(keyed), whole_log(wrapped)
    assert '"POST /v1/completions HTTP/1.1" 200' in keyed_log, keyed_log
    assert '"GET /v1/models HTTP/1.1" 401' in keyed_log, keyed_log
    assert "received request /v1/completions: model=None" in keyed_log, keyed_log
    assert "HTTP/1.1" not in wrapped_log, wrapped_log  # --disable-uvicorn-access-log
    assert "received request" not in wrapped_log, wrapped_log


def test_scheduler_and_memory_flags_reach_the_server(servers):
    log = whole_log(servers["keyed"])
    # --max-num-seqs 3: three KV slots, and the default queue limit of four per slot
    assert "KV capacity 3 x 256 tokens" in log and "queue limit 12" in log, log


def test_the_seed_repeats_the_unseeded_draws_of_a_run(servers):
    """--seed, vLLM's meaning: the same unseeded requests in the same order sample the same
    tokens in another run with the same seed; each request still draws its own."""
    keyed, wrapped = servers["draws"]["keyed"], servers["draws"]["wrapped"]
    assert keyed == wrapped
    assert len({tuple(tokens) for tokens in keyed}) > 1
