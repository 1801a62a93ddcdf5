"""Who may call the server: vLLM's --api-key and its CORS settings (--allowed-origins,
--allowed-methods, --allowed-headers, --allow-credentials).

As in vLLM (its AuthenticationMiddleware), a key guards the routes under /v1 only: /health,
/ping, /metrics, /version, /openapi.json, the tokenizer routes and /invocations stay open,
and a CORS preflight (OPTIONS) is never asked for a key. A request without the right
``Authorization: Bearer <key>`` gets 401 in OpenAI's error shape. CORS wraps everything, the
401 included, so a browser can read why it was refused.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from helios_logprobs.runtime.http.responses import error_response

GUARDED_PREFIX = "/v1"


@dataclass(frozen=True)
class Cors:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class ApiKeys:
    """ASGI middleware: /v1 routes need one of ``keys`` as a bearer token."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        if not keys or not all(keys):
            raise ValueError("--api-key: every key must be a non-empty string")
        self.app = app
        self.digests = tuple(_digest(f"Bearer {key}") for key in keys)

    def allowed(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path != GUARDED_PREFIX and not path.startswith(GUARDED_PREFIX + "/"):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        given = _digest(header.decode("latin-1"))
        # every key compared, in constant time: the answer's timing says nothing of the keys
        return any([secrets.compare_digest(given, d) for d in self.digests])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            "Incorrect API key provided: give `Authorization: Bearer <key>` with a key the "
            "server was started with (--api-key)", None, 401,
            {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def protect(app: FastAPI, api_keys: tuple[str, ...], cors: Cors) -> None:
    """Install the key check (when there are keys) inside CORS, on an app not yet started."""
    if api_keys:
        app.add_middleware(ApiKeys, keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
