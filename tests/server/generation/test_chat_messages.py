"""Chat messages are checked before the template: a malformed message is a 400 whose param is
"messages" and whose message names the message and key (e.g. "messages[1].content")."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from helios_logprobs.runtime.engine.client import EngineInfo
from helios_logprobs.runtime.engine.engine import Engine as RealEngine
from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import Finished, GeneratedToken
from tests.server.helpers import encoder, hf_tokenizer, served_name, strict_json

USER = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class ScriptedEngine:
    """One token then the end, for every request; records the prompts it admits."""

    def __init__(self) -> None:
        self.info = EngineInfo("scripted", 321, 256, 20, True, (0,))
        self.prompts: list[list[int]] = []

    def check(self, prompt_ids, params) -> None:
        RealEngine.check(self, prompt_ids, params)

    async def generate(self, prompt_ids, params):
        self.check(prompt_ids, params)
        self.prompts.append(list(prompt_ids))
        for event in (GeneratedToken(0, 70, None), Finished("length")):
            await asyncio.sleep(0)
            yield event

    def healthy(self) -> bool:
        return True


@pytest.fixture(scope="module")
def app(model_dirs):
    engine = ScriptedEngine()
    return engine, create_app(engine, model_dirs["byte_level"], "scripted")


def chat(app, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app[1])
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post("/v1/chat/completions", json={"max_tokens": 1, **body})

    return asyncio.run(go())


def refused(response: httpx.Response, where: str, *words: str) -> dict:
    assert response.status_code == 400, response.text
    body = strict_json(response.content)["error"]
    assert body == {"message": body["message"], "type": "BadRequestError",
                    "param": "messages", "code": 400}
    assert where in body["message"], body
    for word in words:
        assert word in body["message"], body
    return body


MALFORMED = [
    # content missing or null: only an assistant message with tool_calls may omit it
    ([{"role": "user"}], "messages[0].content", "missing"),
    ([{"role": "user", "content": None}], "messages[0].content", "null"),
    ([{"role": "system", "content": None}, USER], "messages[0].content", "null"),
    ([USER, {"role": "assistant", "content": None}], "messages[1].content", "tool_calls"),
    ([USER, {"role": "assistant"}], "messages[1].content", "missing"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}], "messages[1].content",
     "null"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content", "missing"),
    ([USER, {"role": "developer", "content": None}], "messages[1].content", "null"),
    # role
    ([{"content": "no role"}], "messages[0].role", "role"),
    ([{"role": None, "content": "x"}], "messages[0].role", "role"),
    ([{"role": 5, "content": "x"}], "messages[0].role", "string"),
    ([USER, {"role": "", "content": "x"}], "messages[1].role", "string"),
    # content of the wrong type, or parts other than text
    ([{"role": "user", "content": 5}], "messages[0].content", "int"),
    ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content",
     "dict"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                   {"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[1].type", "Unsupported chat content part type: 'image_url'"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[0].type", "input_audio"),
    ([{"role": "user", "content": [{"text": "untyped"}]}], "messages[0].content[0].type",
     "type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "text"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}],
     "messages[0].content[0].text", "text"),
    ([{"role": "user", "content": ["bare string"]}], "messages[0].content[0]", "object"),
]


@pytest.mark.parametrize(("messages", "where", "word"), MALFORMED, ids=lambda v: str(v)[:40])
def test_malformed_messages_are_refused(app, messages, where, word):
    engine = app[0]
    before = len(engine.prompts)
    refused(chat(app, {"messages": messages}), where, word)
    refused(chat(app, {"messages": messages, "stream": True}), where, word)
    assert len(engine.prompts) == before


@pytest.mark.parametrize("body", [
    {"messages": []},
    {},
    {"messages": None},
    {"messages": "Hi"},
    {"messages": [USER, "not an object"]},
    {"messages": [USER, None]},
], ids=str)
def test_malformed_message_lists_are_refused(app, body):
    response = chat(app, body)
    assert response.status_code == 400, response.text
    assert strict_json(response.content)["error"]["param"] == "messages"


def rendered(model_dir, messages: list[dict], **kwargs) -> list[int]:
    tok = hf_tokenizer(model_dir)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                   **kwargs)
    return encoder(model_dir).encode(text, add_special_tokens=False).ids


ACCEPTED = [
    # (messages as sent, messages as the template sees them)
    ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                   {"type": "text", "text": "b"}]}],
     [{"role": "user", "content": "a\nb"}]),
    ([{"role": "user", "content": ""}], [{"role": "user", "content": ""}]),
    ([{"role": "user", "content": []}], [{"role": "user", "content": ""}]),
    ([{"role": "developer", "content": "Be brief."}, USER],
     [{"role": "developer", "content": "Be brief."}, USER]),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "42", "tool_call_id": "call_1"}],
     [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "42", "tool_call_id": "call_1"}]),
    ([{"role": "user", "content": "Hi", "name": "ann", "extra": None}],
     [{"role": "user", "content": "Hi", "name": "ann"}]),
]


@pytest.mark.parametrize(("messages", "seen"), ACCEPTED, ids=lambda v: str(v)[:40])
def test_well_formed_messages_reach_the_template(app, model_dirs, messages, seen):
    response = chat(app, {"messages": messages})
    assert response.status_code == 200, response.text
    assert app[0].prompts[-1] == rendered(model_dirs["byte_level"], seen)


@pytest.mark.slow
def test_openai_client_sees_the_message_errors(server):
    client = server.client()
    name = served_name(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, max_tokens=2,
                                       messages=[{"role": "user", "content": None}])
    assert info.value.body["param"] == "messages"
    assert "messages[0].content" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert "Unsupported chat content part type" in info.value.body["message"]
    ok = client.chat.completions.create(
        model=name, max_tokens=2, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert ok.usage.completion_tokens == 2
