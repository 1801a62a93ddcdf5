"""run_choice sends a token's delta at once when GeneratedToken.last is False, holds it
otherwise (the finish rides on the last token's delta either way)."""

from __future__ import annotations

import asyncio
from functools import cache

import pytest
import tokenizers

from helios_logprobs.launch.tiny_model import ensure_tiny_model
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.http.output.choice_stream import ChoiceJob, run_choice
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, TokenLogprob
from helios_logprobs.runtime.text.token_bytes import TokenBytes


@cache
def token_bytes() -> TokenBytes:
    tokenizer = tokenizers.Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    return TokenBytes(tokenizer)


def words(count: int) -> list[int]:
    tb = token_bytes()
    found = [i for i in range(tb.size)
             if len(tb.bytes_of(i)) >= 2 and tb.bytes_of(i).isascii()
             and tb.bytes_of(i).strip().isalpha() and not tb.is_special(i)]
    return found[:count]


class GatedEngine:
    """Yields each event only once the test lets it through."""

    def __init__(self, events: list) -> None:
        self.info = EngineInfo("m", token_bytes().size, 64, 20, True)
        self.events = events
        self.gates = [asyncio.Event() for _ in events]

    async def generate(self, prompt_ids, params):
        for gate, event in zip(self.gates, self.events, strict=True):
            await gate.wait()
            yield event


def tokens(ids: list[int], lasts: list[bool | None]) -> list[GeneratedToken]:
    return [GeneratedToken(i, t, -0.5, (TokenLogprob(t, -0.5),), last)
            for i, (t, last) in enumerate(zip(ids, lasts, strict=True))]


async def drive(engine: GatedEngine, job: ChoiceJob | None = None) -> list[tuple[int, object]]:
    """(events let through when the delta came out, delta) for every delta."""
    job = job or ChoiceJob(0, [5, 6], SamplingParams(max_tokens=3, logprobs=1), [])
    out: list[tuple[int, object]] = []
    released = 0

    async def consume() -> None:
        async for delta in run_choice(engine, job, token_bytes()):
            out.append((released, delta))

    task = asyncio.create_task(consume())
    for gate in engine.gates:
        released += 1
        gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
    await task
    return out


@pytest.mark.parametrize("lasts,released", [
    ([False, False, True], [1, 2, 4]),
    ([None, None, True], [2, 3, 4]),
    ([None, None, None], [2, 3, 4]),
])
def test_tokens_go_out_as_soon_as_no_end_can_come_first(lasts, released):
    ids = words(3)
    engine = GatedEngine([*tokens(ids, lasts), Finished("length")])
    out = asyncio.run(drive(engine))
    assert [at for at, _ in out] == released
    deltas = [delta for _, delta in out]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert all(d.text and len(d.positions) == 1 for d in deltas)
    assert [p.token_id for d in deltas for p in d.positions] == ids


def test_stop_strings_keep_the_look_ahead():
    ids = words(3)
    engine = GatedEngine([*tokens(ids, [False, False, True]), Finished("length")])
    job = ChoiceJob(0, [5, 6], SamplingParams(max_tokens=3, logprobs=1), ["\x00never"])
    out = asyncio.run(drive(engine, job))
    assert [at for at, _ in out] == [2, 3, 4]
