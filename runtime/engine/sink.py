"""One request's event queue between the engine's step thread and its consumer."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from helios_logprobs.runtime.engine.frame_tokens import FrameTokens
from helios_logprobs.runtime.engine.prompt_reader import PromptArrays
from helios_logprobs.runtime.outputs import EngineError, Finished, PromptScores


class Wakeups(threading.local):
    """Consumers' wake-ups, deferred on one thread inside ``batch()`` to its end: then one
    call_soon_threadsafe per event loop wakes every sink that got events, instead of one per
    sink (each is a write to the loop's self-pipe: ~10% of the step thread with 16 streams).
    Outside a batch, and on every other thread, a sink is woken at once."""

    def __init__(self) -> None:
        self.pending: dict[asyncio.AbstractEventLoop, list[Sink]] | None = None

    @contextmanager
    def batch(self) -> Iterator[None]:
        self.pending = {}
        try:
            yield
        finally:
            pending, self.pending = self.pending, None
            for loop, sinks in pending.items():
                loop.call_soon_threadsafe(_wake_all, sinks)

    def wake(self, sink: Sink) -> None:
        if self.pending is None:
            sink.loop.call_soon_threadsafe(sink._wake)
        else:
            self.pending.setdefault(sink.loop, []).append(sink)


WAKEUPS = Wakeups()


def _wake_all(sinks: list[Sink]) -> None:
    for sink in sinks:
        sink._wake()


class Sink:
    """Delivers one request's events from the step thread to its consumer.

    An asynchronous consumer (``generate``) holds at most ``limit`` undelivered events. The
    step thread never waits for it: ``put`` refuses an event that would exceed the bound, and
    the engine then ends the request with EngineError("client too slow"). Terminal events
    (Finished, EngineError) always fit, so the consumer still receives every token that was
    accepted, in order, and then the error: nothing is dropped silently. The synchronous
    path (``generate_sync``) returns the whole list anyway and has no bound.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None, limit: int | None) -> None:
        self.loop = loop
        self.limit = limit
        self.events: deque = deque()
        self.lock = threading.Lock()
        self.ready = asyncio.Event() if loop else None
        self.done = threading.Event()
        self.waking = False

    def put(self, event) -> bool:
        """Queue ``event``; False (nothing queued) when the consumer is too far behind."""
        return self.put_all((event,)) == 1

    def put_all(self, events) -> int:
        """Queue ``events`` in order up to the first that does not fit; how many were queued.
        The consumer is woken once, and not again while a wake-up is still on its way."""
        queued = 0
        with self.lock:
            if self.done.is_set():
                return 0
            for event in events:
                terminal = isinstance(event, (Finished, EngineError))
                if not terminal and self.limit is not None and len(self.events) >= self.limit:
                    break
                self.events.append(event)
                queued += 1
                if terminal:
                    self.done.set()
                    break
            wake = bool(queued) and self.loop is not None and not self.waking
            self.waking = self.waking or wake
        if wake:
            WAKEUPS.wake(self)
        return queued

    def put_rows(self, frame: FrameTokens, start: int, stop: int) -> int:
        """Queue a frame's token rows ``start:stop`` as GeneratedToken events (put_all)."""
        return self.put_all(frame.tokens(start, stop))

    def put_prompt(self, scores: PromptArrays) -> bool:
        """Queue a scored chunk's entries as one PromptScores event (put)."""
        return self.put(PromptScores(scores.entries()))

    def _wake(self) -> None:
        with self.lock:
            self.waking = False
        self.ready.set()

    async def get(self):
        while True:
            with self.lock:
                if self.events:
                    return self.events.popleft()
                self.ready.clear()
            await self.ready.wait()
