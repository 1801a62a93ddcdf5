"""GET /openapi.json describes the API a schema fuzzer drives: every route, each POST body as
its request model, and every status and media type the routes answer with (checked against
real answers of the in-process app)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from helios_logprobs.runtime.http.server import create_app
from helios_logprobs.runtime.outputs import Finished
from tests.server.helpers import strict_json
from tests.server.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.slow


def app_for(model_dirs, engine=None):
    engine = engine or ScriptedEngine([Finished("length")])
    return create_app(engine, model_dirs["byte_level"], "scripted", max_request_bytes=4096)


def ask(app, method: str, path: str, body: object = None, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, json=body, **kwargs)

    return asyncio.run(go())


def resolve(doc: dict, ref: str) -> dict:
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def test_every_route_is_documented_with_resolvable_schemas(model_dirs):
    app = app_for(model_dirs)
    doc = strict_json(ask(app, "GET", "/openapi.json").content)
    assert doc["openapi"].startswith("3.1")
    routes = {(re.sub(r":\w+}", "}", path), method.lower()) for route in app.routes  # ({id:path})
              if (path := getattr(route, "path", "")) not in ("/openapi.json",)
              for method in getattr(route, "methods", ()) if method not in ("HEAD", "OPTIONS")}
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == routes
    for ref in refs(doc):
        assert resolve(doc, ref), ref
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = resolve(doc, body["schema"]["$ref"])
    assert {"prompt", "logprobs", "echo", "stream", "prompt_logprobs"} <= set(schema["properties"])


CASES = [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}),
    ("POST", "/v1/completions", {"prompt": "Hi", "logprobs": 99}),
    ("POST", "/v1/completions", {"prompt": "Hi", "model": "other"}),
    ("POST", "/v1/completions", {"prompt": "x" * 5000}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 1, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": "nope"}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/tokenize", {"prompt": 5}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/health", None), ("POST", "/ping", None), ("GET", "/version", None),
    ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/tokenizer_info", None),
]


@pytest.mark.parametrize(("method", "path", "body"), CASES, ids=lambda v: str(v)[:30])
def test_answers_match_the_document(model_dirs, method, path, body):
    """What schemathesis checks first: the status is documented for the operation, and so is
    the answer's media type (none for an empty body)."""
    app = app_for(model_dirs)
    doc = strict_json(ask(app, "GET", "/openapi.json").content)
    response = ask(app, method, path, body)
    documented = doc["paths"][path][method.lower()]["responses"]
    assert str(response.status_code) in documented, (response.status_code, response.text)
    media = response.headers.get("content-type", "").split(";")[0]
    content = documented[str(response.status_code)].get("content", {})
    if response.content:
        assert media in content, (media, list(content))
    if media == "application/json" and response.status_code >= 400:
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "1"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/responses", {"input": "Hi", "background": 0}, "background"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": 1}, "return_token_strs"),
])
def test_types_are_strict_as_documented(model_dirs, path, body, param):
    """The document's types hold: a string, number or integer of another JSON type is refused,
    not coerced (a schema fuzzer's negative cases; OpenAI's API refuses them too)."""
    response = ask(app_for(model_dirs), "POST", path, body)
    assert response.status_code == 400, response.text
    assert strict_json(response.content)["error"]["param"] == param


def test_an_int_is_still_a_number(model_dirs):
    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 1, "top_p": 1}
    assert ask(app_for(model_dirs), "POST", "/v1/completions", body).status_code == 200
