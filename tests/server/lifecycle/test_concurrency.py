"""64 concurrent streams with logprobs: one entry per returned token, attached to that token."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.helpers import (
    TOLERANCE,
    served_name,
    special_ids,
    strict_json,
    token_id_of,
    vocab_bytes,
)

pytestmark = pytest.mark.slow

STREAMS = 64
MAX_TOKENS = 8


def request(name: str, i: int, stream: bool) -> dict:
    body = {"model": name, "prompt": f"Request {i} says hello", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 1000 + i, "logprobs": 2, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def run_streams(server, name: str) -> list[dict]:
    limits = httpx.Limits(max_connections=STREAMS)
    async with httpx.AsyncClient(base_url=server.url, timeout=300.0, limits=limits) as client:

        async def one(i: int) -> dict:
            out = {"text": "", "ids": [], "logprobs": [], "chunks": 0, "usage": None}
            async with client.stream("POST", "/v1/completions", json=request(name, i, True)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = strict_json(line[len("data: "):])
                    if not event["choices"]:
                        out["usage"] = event["usage"]
                        continue
                    choice = event["choices"][0]
                    lp = choice["logprobs"]
                    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
                    out["text"] += choice["text"]
                    out["ids"] += [token_id_of(t) for t in lp["tokens"]]
                    out["logprobs"] += lp["token_logprobs"]
                    out["chunks"] += 1
            return out

        streams = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    # A fresh pool: connections idle past the server's keep-alive would be closed under it.
    async with httpx.AsyncClient(base_url=server.url, timeout=300.0, limits=limits) as client:

        async def whole(i: int) -> dict:
            response = await client.post("/v1/completions", json=request(name, i, False))
            return strict_json(response.content)

        wholes = await asyncio.gather(*(whole(i) for i in range(STREAMS)))
    return list(zip(streams, wholes, strict=True))


def test_64_concurrent_streams(server):
    name = served_name(server)
    table, skipped = vocab_bytes(server.model_dir), special_ids(server.model_dir)
    results = asyncio.run(run_streams(server, name))
    for streamed, whole in results:
        choice = whole["choices"][0]
        assert len(streamed["ids"]) == streamed["usage"]["completion_tokens"] == MAX_TOKENS
        assert streamed["ids"] == [token_id_of(t) for t in choice["logprobs"]["tokens"]]
        # Batch composition differs between the two runs: values agree to FP32 rounding.
        assert streamed["logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"],
                                                     abs=TOLERANCE)
        assert streamed["text"] == choice["text"]
        data = b"".join(table[i] for i in streamed["ids"] if i not in skipped)
        assert streamed["text"] == data.decode("utf-8", errors="replace")
