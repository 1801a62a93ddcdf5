"""The app in-process over a scripted engine: failures after admission, cores without ID
inputs, health; and chat templates against transformers' apply_chat_template."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import math

import httpx
import pytest

from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import EngineError, Finished, GeneratedToken, TokenLogprob
from helios_logprobs.runtime.text.chat_template import ChatTemplate, ChatTemplateError
from tests.server.helpers import strict_json
from tests.server.scripted_engine import ScriptedEngine


def token(index: int, token_id: int, logprob: float | None, alts=()) -> GeneratedToken:
    return GeneratedToken(index, token_id, logprob, tuple(TokenLogprob(*a) for a in alts))


def call(engine, model_dir, method: str, path: str, body=None) -> httpx.Response:
    app = create_app(engine, model_dir, "scripted")

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


def events(response: httpx.Response) -> list:
    blocks = [b for b in response.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]"
    return [strict_json(b[len("data: "):]) for b in blocks[:-1]]


BODY = {"prompt": [5, 6], "max_tokens": 4, "logprobs": 1}


def test_engine_error_after_admission(model_dirs):
    engine = ScriptedEngine([token(0, 70, -1.5, [(70, -1.5)]), EngineError("peer rank 2 lost")])
    whole = call(engine, model_dirs["byte_level"], "POST", "/v1/completions", BODY)
    assert whole.status_code == 500
    body = strict_json(whole.content)["error"]
    assert body["code"] == 500 and "peer rank 2 lost" in body["message"]
    streamed = call(engine, model_dirs["byte_level"], "POST", "/v1/completions",
                    {**BODY, "stream": True})
    assert streamed.status_code == 200
    chunks = events(streamed)
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [-1.5]
    assert "peer rank 2 lost" in chunks[-1]["error"]["message"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_logprob_never_reaches_json(model_dirs, bad):
    engine = ScriptedEngine([token(0, 70, bad, [(70, bad)]), Finished("length")])
    whole = call(engine, model_dirs["byte_level"], "POST", "/v1/completions", BODY)
    assert whole.status_code == 500
    strict_json(whole.content)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "stream": True}
    chunks = events(call(engine, model_dirs["byte_level"], "POST", "/v1/chat/completions", chat))
    assert chunks[-1]["error"]["code"] == 500


def test_negative_infinity_is_sent_as_floor(model_dirs):
    script = [token(0, 70, -math.inf, [(71, -0.1), (70, -math.inf)]), Finished("stop", 0)]
    engine = ScriptedEngine(script)
    response = call(engine, model_dirs["byte_level"], "POST", "/v1/completions",
                    {**BODY, "logprobs": 2, "return_tokens_as_token_ids": True})
    choice = strict_json(response.content)["choices"][0]
    assert choice["logprobs"]["token_logprobs"] == [-9999.0]
    assert choice["logprobs"]["top_logprobs"] == [{"token_id:70": -9999.0, "token_id:71": -0.1}]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert strict_json(response.content)["usage"]["completion_tokens"] == 2


def test_core_without_id_inputs_and_k0(model_dirs):
    no_ids = ScriptedEngine([Finished("length")], k=5, token_ids=False)
    response = call(no_ids, model_dirs["byte_level"], "POST", "/v1/completions",
                    {**BODY, "logprobs": 0, "logprob_token_ids": [1, 2]})
    assert response.status_code == 400
    assert strict_json(response.content)["error"]["param"] == "logprob_token_ids"
    response = call(no_ids, model_dirs["byte_level"], "POST", "/v1/completions",
                    {**BODY, "logprobs": 6})
    assert strict_json(response.content)["error"]["param"] == "logprobs"
    assert no_ids.requests == 0


def test_health_follows_the_engine(model_dirs):
    engine = ScriptedEngine([Finished("length")])
    assert call(engine, model_dirs["byte_level"], "GET", "/health").status_code == 200
    engine.alive = False
    assert call(engine, model_dirs["byte_level"], "GET", "/health").status_code == 503
    response = call(engine, model_dirs["byte_level"], "POST", "/v1/completions", BODY)
    assert response.status_code == 503 and engine.requests == 0
    # vLLM's /ping (GET and POST) answers as /health does.
    for method in ("GET", "POST"):
        assert call(engine, model_dirs["byte_level"], method, "/ping").status_code == 503
    engine.alive = True
    for method in ("GET", "POST"):
        assert call(engine, model_dirs["byte_level"], method, "/ping").status_code == 200


def test_version_and_wrong_methods(model_dirs):
    engine = ScriptedEngine([Finished("length")])
    response = call(engine, model_dirs["byte_level"], "GET", "/version")
    assert strict_json(response.content) == {
        "version": importlib.metadata.version("helios-logprobs")}
    wrong = call(engine, model_dirs["byte_level"], "GET", "/v1/completions")
    assert wrong.status_code == 405
    assert strict_json(wrong.content)["error"]["type"] == "MethodNotAllowedError"


CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "café 🙂"},
     {"role": "assistant", "content": "Sure"}, {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_chat_template_matches_transformers(model_dirs, kind):
    from transformers import AutoTokenizer

    model_dir = model_dirs[kind]
    reference = AutoTokenizer.from_pretrained(model_dir)
    template = ChatTemplate.from_model_dir(model_dir)
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = reference.apply_chat_template(messages, add_generation_prompt=add,
                                                     tokenize=False)
            assert template.render(messages, add_generation_prompt=add) == expected
    final = [*CONVERSATIONS[0], {"role": "assistant", "content": "The answer is"}]
    expected = reference.apply_chat_template(final, continue_final_message=True, tokenize=False)
    got = template.render(final, add_generation_prompt=False, continue_final_message=True)
    assert got == expected
    if kind == "byte_level":
        with pytest.raises(ChatTemplateError, match="role bad"):
            template.render([{"role": "bad", "content": "x"}])


def test_chat_template_sources(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path) is None
    default = "{{ messages | tojson }}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"},
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": default}],
    }))
    rendered = ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "é"}])
    assert rendered == '[{"role": "user", "content": "é"}]</s>'
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "u", "content": "a"}]) == "a!"
