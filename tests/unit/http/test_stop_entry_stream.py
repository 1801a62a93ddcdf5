"""A scoring request's terminating stop token (Finished.entry, issue 39) through a choice's
stream: its entry comes last, at the end of the text (after text a stop string's prefix held
back), its text stays out of the output unless include_stop_str_in_output keeps it (then the
entry starts that text), and the usage counts it once."""

from __future__ import annotations

import asyncio
from functools import cache

import tokenizers

from helios_logprobs.launch.tiny_model import EOS, ensure_tiny_model
from helios_logprobs.runtime.engine.client import EngineInfo, SamplingParams
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.output.choice_stream import ChoiceJob, run_choice
from helios_logprobs.runtime.outputs import Finished, GeneratedToken, TokenLogprob


@cache
def tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))


@cache
def assets() -> ModelAssets:
    return ModelAssets(ensure_tiny_model(), "tiny", tokenizer().get_vocab_size())


def word(text: str) -> int:
    token = tokenizer().token_to_id(text)
    assert token is not None, text
    return token


class ScriptedEngine:
    def __init__(self, events: list) -> None:
        self.info = EngineInfo("m", tokenizer().get_vocab_size(), 64, 20, True,
                               eos_token_ids=(word(EOS),))
        self.events = events

    async def generate(self, prompt_ids, params):
        for event in self.events:
            yield event


def run(stop: int, entry: bool, stops: tuple[str, ...] = (), **options):
    """A choice that emits "Ġthe" and ends with `stop` (its entry on the finish or not):
    (text, [(token id, offset)], completion tokens)."""
    first = word("Ġthe")
    scored = GeneratedToken(1, stop, -0.25, (TokenLogprob(stop, -0.25),)) if entry else None
    job = ChoiceJob(0, [5, 6], SamplingParams(max_tokens=8, logprobs=0,
                                              stop_token_entry=entry), list(stops),
                    options.get("include_stop_str_in_output", False),
                    options.get("skip_special_tokens", True))
    engine = ScriptedEngine([GeneratedToken(0, first, -0.5, (TokenLogprob(first, -0.5),)),
                             Finished("stop", stop, scored)])

    async def collect() -> list:
        return [d async for d in run_choice(engine, job, assets().token_bytes,
                                            assets().eos_token_id)]

    deltas = asyncio.run(collect())
    assert deltas[-1].finish_reason == "stop"
    positions = [(p.token_id, p.text_offset) for d in deltas for p in d.positions]
    return "".join(d.text for d in deltas), positions, sum(d.tokens for d in deltas)


def test_the_entry_comes_last_at_the_end_of_the_text():
    eos, the = word(EOS), word("Ġthe")
    assert run(eos, entry=False) == (" the", [(the, 0)], 2)
    assert run(eos, entry=True) == (" the", [(the, 0), (eos, 4)], 2)
    assert run(eos, entry=True, skip_special_tokens=False) == (" the", [(the, 0), (eos, 4)], 2)
    stop = word("Ġand")  # a stop_token_ids token: its text is left out too
    assert run(stop, entry=True) == (" the", [(the, 0), (stop, 4)], 2)


def test_held_text_is_released_before_the_entry():
    eos, the = word(EOS), word("Ġthe")
    assert run(eos, entry=True, stops=(" the end",)) == (" the", [(the, 0), (eos, 4)], 2)


def test_include_stop_str_keeps_the_text_and_the_entry_starts_it():
    stop, the = word("Ġand"), word("Ġthe")
    got = run(stop, entry=True, include_stop_str_in_output=True)
    assert got == (" the and", [(the, 0), (stop, 4)], 2)
    assert run(stop, entry=False, include_stop_str_in_output=True) == (" the and",
                                                                     [(the, 0)], 2)
