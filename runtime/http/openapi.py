"""GET /openapi.json: the API as OpenAPI 3.1, for clients and schema fuzzers.

The routes read their bodies themselves (runtime/http/bodies.py: size limit, off-loop decoding,
vLLM's error object), so FastAPI cannot see the request models. This document adds them: each
POST route's body is its pydantic model's JSON schema (nested models under
components/schemas), and every route lists the statuses it answers with, errors as vLLM's
error object. Streaming routes document both of their media types.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from helios_logprobs.runtime.http.protocol.models import (
    EFFORTS,
    SUMMARIES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/responses": (ResponsesRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
    "/invocations": (ChatCompletionRequest, CompletionRequest),
}
STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"}
GENERATION_ERRORS = {
    400: "refused before admission (the message and `param` name the parameter)",
    404: "unknown model",
    413: "body over the size limit",
    429: "at the queue limit (Retry-After)",
    499: "the client went away before the response",
    500: "failed after admission",
    503: "the engine is not healthy",
}
TOKENIZER_ERRORS = {400: GENERATION_ERRORS[400], 404: GENERATION_ERRORS[404],
                    413: GENERATION_ERRORS[413]}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": "integer"},
        },
    }},
}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
OBJECT = {"type": "object"}
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}}}
"""One server-sent event: its data (a JSON object, or [DONE]) and, for the Responses API, its
event type."""


def _errors(statuses: dict[int, str]) -> dict[str, Any]:
    return {str(code): {"description": why, "content": {"application/json": {"schema": ERROR_REF}}}
            for code, why in statuses.items()}


def _generation(path: str) -> dict[str, Any]:
    content = {"application/json": {"schema": OBJECT}}
    if path in STREAMING:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    errors = GENERATION_ERRORS if path in STREAMING else TOKENIZER_ERRORS
    return {"200": {"description": "the response (server-sent events with stream)",
                    "content": content}, **_errors(errors)}


def _body(models: tuple[type[BaseModel], ...], schemas: dict[str, Any]) -> dict[str, Any]:
    refs = []
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


GETS: dict[str, dict[str, Any]] = {
    "/health": {"200": {"description": "healthy (empty body)"},
                **_errors({503: GENERATION_ERRORS[503]})},
    "/ping": {"200": {"description": "healthy (empty body)"},
              **_errors({503: GENERATION_ERRORS[503]})},
    "/metrics": {"200": {"description": "Prometheus text",
                         "content": {"text/plain": {"schema": {"type": "string"}}}}},
    "/v1/models/{model_id}": {"200": {"description": "the model card",
                                      "content": {"application/json": {"schema": OBJECT}}},
                              **_errors({404: GENERATION_ERRORS[404]})},
}


def _ids(vocab: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": vocab - 1}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


FALSY = {"anyOf": [{"type": "null"}, {"const": False}, {"const": 0}, {"const": ""},
                   {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]}
TEXT_PARTS = {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "minLength": 1},
    "content": {"anyOf": [{"type": "string"}, TEXT_PARTS]}}}
STOPS = _nullable({"anyOf": [
    {"type": "string", "minLength": 1, "maxLength": 256},
    {"type": "array", "maxItems": 64,
     "items": {"type": "string", "minLength": 1, "maxLength": 256}}]})


def _sampling(vocab: int, k: int, max_model_len: int, scoring: bool) -> dict[str, Any]:
    """What the server refuses of the shared fields, where one field decides it: the bounds
    vLLM's SamplingParams checks, ids inside the vocabulary, the values of the fields the field
    policy refuses that it still accepts (protocol/refusals.py)."""
    number = {"type": "number"}
    return {
        "temperature": _nullable({**number, "minimum": 0, "maximum": 2}),
        "top_p": _nullable({**number, "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "min_p": _nullable({**number, "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({**number, "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({**number, "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({**number, "exclusiveMinimum": 0}),
        "n": {"type": "integer", "minimum": 1, "maximum": 256},
        "stop": STOPS,
        "stop_token_ids": _nullable({"type": "array", "items": _ids(vocab)}),
        "allowed_token_ids": _nullable({"type": "array", "minItems": 1, "items": _ids(vocab)}),
        "min_tokens": {"type": "integer", "minimum": 0},
        "bad_words": _nullable({"type": "array", "items": {"type": "string", "minLength": 1}}),
        "truncate_prompt_tokens": {"anyOf": [
            {"const": -1}, {"type": "integer", "minimum": 1, "maximum": max_model_len},
            {"type": "null"}]},
        "prompt_logprobs": ({"anyOf": [{"type": "integer", "minimum": 0, "maximum": k},
                                       {"type": "null"}]} if scoring else {"type": "null"}),
        "stream_interval": _nullable({"type": "integer", "minimum": 1}),
        "cache_salt": _nullable({"type": "string", "minLength": 1}),
        "use_beam_search": {"const": False},
        "length_penalty": {"anyOf": [{"const": 1.0}, {"type": "null"}]},
        "logits_processors": FALSY, "watermarking": FALSY,
        "spaces_between_special_tokens": {"const": True},
        "vllm_xargs": {"type": "null"}, "kv_transfer_params": {"type": "null"},
        "repetition_detection": {"type": "null"},
        "response_format": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"},
                    "schema": {"type": ["object", "boolean"]},
                    "strict": _nullable({"type": "boolean"})}}}}]},
        "structured_outputs": _nullable({
            "type": "object", "additionalProperties": False, "properties": {
                "json": {"type": ["object", "boolean", "string", "null"]},
                "regex": _nullable({"type": "string", "minLength": 1}),
                "choice": _nullable({"type": "array", "minItems": 1,
                                     "items": {"type": "string"}}),
                "grammar": _nullable({"type": "string", "minLength": 1}),
                "json_object": _nullable({"const": True}),
                "disable_any_whitespace": {"type": "boolean"}}}),
        **{name: {"type": "null"} for name in (
            "guided_json", "guided_regex", "guided_choice",
            "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")},
    }


def _tighten(schemas: dict[str, Any], vocab: int, k: int, max_model_len: int,
             scoring: bool) -> None:
    shared = _sampling(vocab, k, max_model_len, scoring)
    room = {"type": "integer", "maximum": max_model_len - 1}
    token_list = {"type": "array", "minItems": 1, "items": _ids(vocab)}
    counts = (_nullable({"type": "integer", "minimum": 0, "maximum": k}) if k
              else {"type": "null"})  # (a core without logprob outputs refuses them all)
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    for model in (completion, chat):
        model["properties"].update(shared)
    completion["properties"].update({
        "prompt": {"anyOf": [
            {"type": "string", "minLength": 1}, token_list,
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": token_list}]},
        "logprobs": counts,
        "max_tokens": _nullable({**room, "minimum": 0}),
        "suffix": {"anyOf": [{"type": "null"}, {"const": ""}]}, "prompt_embeds": FALSY,
    })
    completion["required"] = ["prompt"]
    chat["properties"].update({
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "top_logprobs": counts,
        "max_tokens": _nullable({**room, "minimum": 1}),
        "max_completion_tokens": _nullable({**room, "minimum": 1}),
        "tools": {"type": "null"}, "functions": FALSY,
        "tool_choice": {"enum": [None, "none"]},
        "function_call": {"enum": [None, "none", "auto"]},
        "modalities": {"anyOf": [{"type": "null"}, {"const": ["text"]}]},
        **{name: {"type": "null"} for name in (
            "chat_template", "documents", "mm_processor_kwargs", "audio",
            "web_search_options")},
    })
    # continue_final_message needs add_generation_prompt false (it defaults to true)
    continues = {"if": {"required": ["continue_final_message"],
                        "properties": {"continue_final_message": {"const": True}}},
                 "then": {"required": ["add_generation_prompt"],
                          "properties": {"add_generation_prompt": {"const": False}}}}
    chat.update(continues)
    schemas["TokenizeChatRequest"].update(continues)
    responses = schemas["ResponsesRequest"]["properties"]
    responses.update({
        name: shared[name] for name in ("temperature", "top_p", "top_k")})
    responses.update({
        "top_logprobs": counts, "max_output_tokens": _nullable({**room, "minimum": 1}),
        "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
        "previous_response_id": {"type": "null"},
        "background": {"enum": [None, False]},
        "reasoning": _nullable({"type": "object", "properties": {
            "effort": {"enum": [None, *EFFORTS]},
            "summary": {"enum": [None, *SUMMARIES]},
            "generate_summary": {"enum": [None, *SUMMARIES]}}}),
        "text": _nullable({"type": "object", "properties": {"format": _nullable({
            "type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "name": {"type": "string"}, "schema": {"type": ["object", "boolean"]},
                "strict": _nullable({"type": "boolean"})}})}}),
    })
    schemas["TokenizeChatRequest"]["properties"].update({
        "messages": chat["properties"]["messages"], "tools": {"type": "null"},
        "chat_template": {"type": "null"}, "mm_processor_kwargs": {"type": "null"}})
    schemas["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": _ids(vocab)}


def openapi_document(app: FastAPI, version: str, *, vocab: int, k: int, max_model_len: int,
                     scoring: bool) -> dict[str, Any]:
    """The document (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    with warnings.catch_warnings():  # (one route with two methods shares an id: fixed below)
        warnings.filterwarnings("ignore", "Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=version, routes=app.routes)
    seen: set[str] = set()
    for operations in doc["paths"].values():
        for method, operation in operations.items():
            if operation["operationId"] in seen:
                operation["operationId"] += f"_{method}"
            seen.add(operation["operationId"])
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            if method == "post" and path in BODIES:
                operation["requestBody"] = _body(BODIES[path], schemas)
                operation["responses"] = _generation(path)
            elif path in GETS:
                operation["responses"] = GETS[path]
            else:
                operation["responses"] = {"200": {
                    "description": "OK", "content": {"application/json": {"schema": OBJECT}}}}
    _tighten(schemas, vocab, k, max_model_len, scoring)
    app.openapi_schema = doc
    return doc
