"""The bounded queues between the engine core and an API server, on real ZeroMQ sockets.

- A client that never reads: its API server holds at most ``max_pending_events`` of its
  events, then ends it with "client too slow" and sends the core an Abort for it; the core's
  own buffer (one step's StepPacker) is empty after every flush whatever the client does.
- An API server that stops reading altogether: the core's sends fail after a bounded number
  of queued messages (the high-water marks) instead of queuing without end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import numpy as np
import pytest

from helios_logprobs.collectives.codec import decode, encode
from helios_logprobs.collectives.frontend import CoreSockets, ServerSockets
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.engine.frame_tokens import FrameTokens
from helios_logprobs.runtime.frontend.messages import (
    Abort,
    CoreStats,
    Hello,
    Submit,
    Welcome,
)
from helios_logprobs.runtime.frontend.packing import StepPacker
from helios_logprobs.runtime.frontend.remote_engine import RemoteEngine
from helios_logprobs.runtime.outputs import EngineError, GeneratedToken, TokenLogprobs

STATS = CoreStats(True, 0, 1, 0.0, {})
BOUND = 16


def welcome() -> Welcome:
    return Welcome(EngineInfo("m", 100, 64, 20, True, (0,)), 4, BOUND, None, STATS)


@pytest.fixture
def link(tmp_path):
    core = CoreSockets(tmp_path, 1, hwm=4, send_timeout_ms=300)
    answered = threading.Thread(target=lambda: (
        isinstance(decode(core.receive(10_000)), Hello) and core.send(0, encode(welcome()))))
    answered.start()
    engine = RemoteEngine(ServerSockets(tmp_path, 0, hwm=4), 0, welcome_timeout_s=10)
    answered.join()
    yield core, engine
    engine.close()
    core.close()


def step(request_id: int, index: int) -> bytes:
    packer = StepPacker()
    frame = FrameTokens.of([GeneratedToken(index, 7, -0.5, TokenLogprobs([7], [-0.5]))])
    packer.add_rows(request_id, frame, 0, 1)
    out = encode(packer.take(STATS))
    assert not packer  # the core keeps nothing of a step once it is taken
    return out


def test_a_client_that_never_reads_is_aborted_at_the_bound(link):
    core, engine = link

    async def scenario() -> tuple[list, int]:
        events = engine.generate([1, 2, 3], SamplingParams(max_tokens=1000, logprobs=1))
        first = asyncio.ensure_future(events.__anext__())  # submits, then waits
        submit = await asyncio.to_thread(lambda: decode(core.receive(10_000)))
        assert isinstance(submit, Submit) and submit.prompt_ids.tolist() == [1, 2, 3]
        request_id = submit.request_id
        aborted = None
        sent = 0
        for index in range(BOUND * 4):  # the client reads one event, then nothing
            assert await asyncio.to_thread(core.send, 0, step(request_id, index))
            sent += 1
            data = await asyncio.to_thread(core.receive, 50)
            if data is not None:
                aborted = decode(data)
                break
        assert isinstance(aborted, Abort) and aborted.request_ids == (request_id,)
        got = [await first]
        with contextlib.suppress(EngineError):
            async for event in events:
                got.append(event)
        return got, sent

    got, sent = asyncio.run(scenario())
    # Every event up to the bound arrives in order, then the "client too slow" error.
    assert [e.index for e in got] == list(range(len(got)))
    assert BOUND <= len(got) <= BOUND + 1 and sent <= BOUND + 2


def test_an_api_server_that_stops_reading_pushes_back(tmp_path):
    core = CoreSockets(tmp_path, 1, hwm=4, send_timeout_ms=200)
    server = ServerSockets(tmp_path, 0, hwm=4)  # connected, never reads
    try:
        payload = encode(Abort(0, tuple(range(1000))))
        accepted = 0
        while core.send(0, payload) and accepted < 1000:
            accepted += 1
        assert accepted < 64, accepted  # both high-water marks, then refusals
        assert not core.send(0, payload, timeout_ms=0)
    finally:
        server.close()
        core.close()


def test_submit_arrays_stay_integers():
    with pytest.raises(ValueError, match="prompt_ids"):
        Submit(0, 1, np.array([1.5]), SamplingParams())
