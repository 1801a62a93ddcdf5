"""SSE framing: Completions/Chat data lines ending in [DONE]; the Responses API's typed events
(no [DONE]). A failure after the first event becomes an error event in either framing."""

from __future__ import annotations

import asyncio
import json

from helios_logprobs.runtime.http.responses import sse_events, sse_stream


async def _chunks(fail: bool):
    yield {"type": "response.created", "sequence_number": 0}
    yield {"type": "response.in_progress", "sequence_number": 1}
    if fail:
        raise RuntimeError("lost a peer")


def _blocks(framing, fail: bool) -> list[str]:
    async def run() -> bytes:
        return b"".join([piece async for piece in framing(_chunks(fail))])

    return [b for b in asyncio.run(run()).decode().split("\n\n") if b]


def test_responses_events_name_their_type_and_end_without_done():
    blocks = _blocks(sse_events, fail=False)
    assert blocks == [
        'event: response.created\ndata: {"type":"response.created","sequence_number":0}',
        'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1}',
    ]


def test_a_responses_failure_is_an_error_event_numbered_next():
    head, data = _blocks(sse_events, fail=True)[-1].split("\n")
    error = json.loads(data[len("data: "):])
    assert head == "event: error"
    assert error["type"] == "error" and error["sequence_number"] == 2
    assert "lost a peer" in error["message"]


def test_chat_framing_ends_in_done_after_an_error_event():
    blocks = _blocks(sse_stream, fail=True)
    assert blocks[-1] == "data: [DONE]"
    error = json.loads(blocks[-2][len("data: "):])["error"]
    assert error["code"] == 500 and "lost a peer" in error["message"]
