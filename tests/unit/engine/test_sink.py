"""runtime/engine/sink.py: events reach an asyncio consumer in order, a slow consumer is
refused rather than buffered without bound, and a step's wake-ups go out once per loop."""

from __future__ import annotations

import asyncio
import threading

from helios_logprobs.runtime.engine.sink import WAKEUPS, Sink
from helios_logprobs.runtime.outputs import Finished


class CountingLoop:
    """A running event loop on its own thread, counting call_soon_threadsafe."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.calls = 0
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        original = self.loop.call_soon_threadsafe

        def counted(*args):
            self.calls += 1
            return original(*args)

        self.loop.call_soon_threadsafe = counted

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


async def drain(sink: Sink) -> list:
    events = []
    while not events or not isinstance(events[-1], Finished):
        events.append(await sink.get())
    return events


def test_a_batch_wakes_every_sink_of_a_loop_with_one_call():
    loop = CountingLoop()
    try:
        sinks = [Sink(loop.loop, None) for _ in range(5)]
        with WAKEUPS.batch():
            for i, sink in enumerate(sinks):
                sink.put_all([i, i + 10, Finished("length")])
            assert loop.calls == 0
            assert not any(s.ready.is_set() for s in sinks)
        assert loop.calls == 1
        for i, sink in enumerate(sinks):
            assert loop.run(drain(sink)) == [i, i + 10, Finished("length")]
    finally:
        loop.close()


def test_outside_a_batch_and_on_other_threads_a_sink_is_woken_at_once():
    loop = CountingLoop()
    try:
        sinks = [Sink(loop.loop, None) for _ in range(3)]
        sinks[0].put_all(["a", Finished("stop")])
        with WAKEUPS.batch():  # (a batch on this thread does not hold another thread's puts)
            other = threading.Thread(target=sinks[1].put_all, args=(["b", Finished("stop")],))
            other.start()
            other.join()
            assert loop.calls == 2
        assert loop.calls == 2  # (an empty batch sends nothing)
        assert loop.run(drain(sinks[0])) == ["a", Finished("stop")]
        assert loop.run(drain(sinks[1])) == ["b", Finished("stop")]
    finally:
        loop.close()


def test_a_failing_batch_still_wakes_what_it_queued():
    loop = CountingLoop()
    sink = Sink(loop.loop, None)
    try:
        try:
            with WAKEUPS.batch():
                sink.put_all(["x", Finished("length")])
                raise RuntimeError("frame read failed")
        except RuntimeError:
            pass
        assert loop.run(drain(sink)) == ["x", Finished("length")]
    finally:
        loop.close()


def test_a_slow_consumer_is_refused_past_its_limit_but_always_gets_the_end():
    loop = CountingLoop()
    sink = Sink(loop.loop, 2)
    try:
        assert sink.put_all([1, 2, 3]) == 2
        assert sink.put(Finished("length"))
        assert loop.run(drain(sink)) == [1, 2, Finished("length")]
    finally:
        loop.close()
