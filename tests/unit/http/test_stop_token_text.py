"""A choice ended by a token: vLLM's stop_reason (None only for the tokenizer's EOS; the
model's other EOS ids and stop_token_ids report their id) and, with
include_stop_str_in_output, the stop token's text at the end of the output (still no entry)."""

from __future__ import annotations

import asyncio
from functools import cache

import pytest
import tokenizers
from transformers import AutoTokenizer

from helios_logprobs.launch.tiny_model import EOS, EOT, ensure_tiny_model
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
        eos = (tokenizer().token_to_id(EOS), tokenizer().token_to_id(EOT))
        self.info = EngineInfo("m", tokenizer().get_vocab_size(), 64, 20, True,
                               eos_token_ids=eos)
        self.events = events

    async def generate(self, prompt_ids, params):
        for event in self.events:
            yield event


def finish(stop_token: int | None, **params) -> tuple[str, object, int]:
    """(text, stop_reason, entries) of a choice that emits "Ġthe" and then stops."""
    first = word("Ġthe")
    job = ChoiceJob(0, [5, 6], SamplingParams(max_tokens=8, logprobs=0, **{
        k: v for k, v in params.items() if k in ("ignore_eos", "stop_token_ids")}), [],
        params.get("include_stop_str_in_output", False),
        params.get("skip_special_tokens", True))
    engine = ScriptedEngine([GeneratedToken(0, first, -0.5, (TokenLogprob(first, -0.5),)),
                             Finished("stop", stop_token)])

    async def run() -> list:
        return [d async for d in run_choice(engine, job, assets().token_bytes,
                                            assets().eos_token_id)]

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "stop"
    return ("".join(d.text for d in deltas), deltas[-1].stop_reason,
            sum(len(d.positions) for d in deltas))


def test_the_tokenizer_eos_is_vllms_primary_eos():
    hf = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    assert assets().eos_token_id == hf.eos_token_id == tokenizer().token_to_id(EOS)


def test_stop_reason_is_none_only_for_the_primary_eos():
    eos, eot, stop = word(EOS), word(EOT), word("Ġand")
    assert finish(eos)[1] is None
    assert finish(eot)[1] == eot  # generation_config.json's end of turn: vLLM's stop_token_ids
    assert finish(stop, stop_token_ids=(stop,))[1] == stop
    assert finish(eos, ignore_eos=True, stop_token_ids=(eos,))[1] == eos
    assert finish(None)[1] is None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_keeps_its_text_only_with_include_stop_str_in_output(include):
    stop = word("Ġand")
    text, reason, entries = finish(stop, stop_token_ids=(stop,), include_stop_str_in_output=include)
    assert text == (" the and" if include else " the")
    assert (reason, entries) == (stop, 1)  # the stop token never has an entry


def test_a_special_stop_token_shows_only_when_special_tokens_are_kept():
    eot = word(EOT)
    assert finish(eot, include_stop_str_in_output=True)[0] == " the"
    shown = finish(eot, include_stop_str_in_output=True, skip_special_tokens=False)[0]
    assert shown == " the" + EOT
