"""POST /v1/completions in vLLM's wire format (non-streaming and SSE).

Prompt scores (a server started with --prompt-logprobs): `prompt_logprobs: N` returns each
choice's `prompt_logprobs` (vLLM's list: null for position 0, then a dict per position);
`echo` with `logprobs` prepends the prompt positions to the choice's logprobs arrays (the
first entry null), with offsets into the echoed prompt text. The engine is asked for
max(prompt_logprobs, logprobs) natural alternatives; each use takes its own first N. In
streams the prompt entries come first, in prompt order, one chunk per scored chunk (the first
also carries the echoed text).

A scoring request (echo with logprobs) reports an entry for every generated token, a
terminating EOS or stop token included (its text still left out), as vLLM does: harnesses
read `token_logprobs[ctxlen:-1]`, assuming the last entry is the generated token's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from helios_logprobs.ranks.contract.requests import (
    RequestError,
    check_token_ids,
    check_token_ids_given,
)
from helios_logprobs.runtime.engine.client import EngineClient, EngineInfo
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.output.choice_stream import ChoiceJob, Delta, Totals
from helios_logprobs.runtime.http.output.choices import collect, envelope, stream_chunks
from helios_logprobs.runtime.http.output.wire import (
    Position,
    completion_logprobs,
    prompt_context,
    prompt_position,
    request_prompt_logprobs,
)
from helios_logprobs.runtime.http.protocol.models import CompletionRequest
from helios_logprobs.runtime.http.protocol.params import (
    bad_word_ids,
    build_params,
    capped_max_tokens,
    check_choices,
    check_request,
    check_stops,
    choice_seed,
    resolve_max_tokens,
    truncate,
    truncation,
    wire_mode,
)
from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.text.detokenizer import detokenize
from helios_logprobs.runtime.text.token_bytes import TokenBytes

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt whose positions lead the choice's logprobs (echo with logprobs)."""

    ids: list[int]
    offsets: list[int]
    """Character offset of each prompt token in the echoed text."""


@dataclass
class PreparedCompletion:
    request: CompletionRequest
    jobs: list[ChoiceJob]
    echo_texts: dict[int, str]
    prompt_tokens: dict[int, int]
    """Prompt tokens by choice index (usage counts each prompt once)."""
    total_prompt_tokens: int
    mode: WireMode | None
    """None: no logprobs requested."""
    echoed: dict[int, EchoedPrompt]
    """By choice index: the prompts whose positions are echoed in logprobs."""
    totals: Totals = field(default_factory=Totals)
    """Usage so far (the server's metrics read it when the response ends)."""


def _check_logprobs(req: CompletionRequest, scoring: bool) -> bool:
    """The endpoint's own pairing rules; whether the prompt positions are echoed in logprobs.
    Ranges and what the core serves are checked once, by the engine."""
    if req.logprobs is not None and req.logprobs < 0 and req.logprobs != -1:
        raise RequestError("logprobs", "`logprobs` must be a positive value or -1.")
    check_token_ids_given(req.logprob_token_ids)
    if req.logprob_token_ids is not None and req.logprobs is None:
        raise RequestError("logprob_token_ids",
                           "when using `logprob_token_ids`, `logprobs` must be set.")
    if not req.echo or req.logprobs is None:
        return False
    if req.logprob_token_ids is not None:
        raise RequestError(
            "echo",
            "echo with logprobs reports the prompt positions' natural alternatives; it cannot "
            "be combined with logprob_token_ids",
        )
    if not scoring:
        raise RequestError(
            "echo",
            "echo with logprobs needs prompt logprobs: this server was started without "
            "--prompt-logprobs (no prompt scoring buffers); request echo or logprobs, not both",
        )
    return True


def _engine_prompt_logprobs(req: CompletionRequest, echo_logprobs: bool) -> int | None:
    """What the engine scores: max(prompt_logprobs, logprobs) when echo asks for logprobs."""
    if not echo_logprobs:
        return req.prompt_logprobs
    return max(req.prompt_logprobs or 0, req.logprobs or 0)


def echo_text(tb: TokenBytes, text: str | None, ids: list[int]) -> tuple[str, list[int]]:
    """The echoed prompt text and each prompt token's character offset in it.

    A token-id prompt is decoded with its special tokens kept (as vLLM echoes one). A text
    prompt is echoed as sent; its offsets come from the decoding that reproduces it (special
    tokens kept, else skipped: e.g. a BOS the tokenizer added sits at offset 0). When no
    decoding reproduces it (a lossy tokenizer), offsets are clipped to the text."""
    decoded, offsets = detokenize(tb, ids, skip_special_tokens=False)
    if text is None or decoded == text:
        return decoded, offsets
    _, skipped_offsets = detokenize(tb, ids, skip_special_tokens=True)
    return text, [min(offset, len(text)) for offset in skipped_offsets]


EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
"""vLLM's wording (clients match it), for a missing, null or empty prompt or an empty item."""


def _prompts(req: CompletionRequest, assets: ModelAssets, info: EngineInfo
             ) -> list[tuple[str | None, list[int]]]:
    """Each prompt's text (None for ids) and ids. Token ids are checked against the vocabulary
    before any use (echo decodes them); a text longer than the context can hold is refused
    before it is tokenized."""
    prompt = req.prompt
    if prompt is None:
        raise RequestError("prompt", EMPTY_PROMPT)
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise RequestError("prompt", EMPTY_PROMPT)
    keep = truncation(req, info.max_model_len)
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise RequestError("prompt", EMPTY_PROMPT)
            ids = assets.encode(item, add_special_tokens=req.add_special_tokens, param="prompt",
                                max_model_len=info.max_model_len if keep is None else None)
        else:
            check_token_ids("prompt", item, min(info.vocab_size, assets.token_bytes.size))
            ids = list(item)
        kept = truncate(ids, keep, req.truncation_side)
        # A truncated text is echoed from its kept ids, as vLLM echoes the engine's prompt.
        out.append((item if isinstance(item, str) and kept is ids else None, kept))
    return out


def prepare_completion(
    req: CompletionRequest, engine: EngineClient, assets: ModelAssets
) -> PreparedCompletion:
    """Everything refused before admission raises RequestError here (HTTP 400)."""
    defaults = assets.sampling_defaults
    check_request(req, defaults)
    info = engine.info
    echo_logprobs = _check_logprobs(req, info.prompt_logprobs)
    engine_prompt_logprobs = _engine_prompt_logprobs(req, echo_logprobs)
    stops = req.stop_strings()
    check_stops(stops)
    prompts = _prompts(req, assets, info)
    bad_words = bad_word_ids(req.bad_words, assets.word_ids)
    check_choices(req.n, len(prompts))
    explicit = req.max_tokens if "max_tokens" in req.model_fields_set else None
    jobs, echo_texts, prompt_tokens, echoed = [], {}, {}, {}
    total = 0
    for p, (text, ids) in enumerate(prompts):
        if not ids:
            raise RequestError("prompt", EMPTY_PROMPT)
        max_tokens = resolve_max_tokens(
            explicit, len(ids), info.max_model_len, "max_tokens",
            default=DEFAULT_MAX_TOKENS,
            allow_zero=bool(req.echo),
        )
        max_tokens = capped_max_tokens(max_tokens, defaults)
        total += len(ids)
        echo, prompt = None, None
        if req.echo:
            if text is not None and not echo_logprobs:
                echo = text
            else:
                echo, offsets = echo_text(assets.token_bytes, text, ids)
                prompt = EchoedPrompt(ids, offsets) if echo_logprobs else None
        for i in range(req.n):
            params = build_params(
                req, defaults, max_tokens=max_tokens, logprobs=req.logprobs,
                logprob_token_ids=req.logprob_token_ids, seed=choice_seed(req.seed, i),
                prompt_logprobs=engine_prompt_logprobs, bad_words=bad_words,
                stop_token_entry=echo_logprobs,
            )
            engine.check(ids, params)  # (every choice: a 400 before anything streams)
            index = p * req.n + i
            jobs.append(ChoiceJob(
                index, ids, params, stops, req.include_stop_str_in_output,
                req.skip_special_tokens, offset_base=len(echo) if echo else 0,
            ))
            prompt_tokens[index] = len(ids)
            if echo is not None and not req.return_token_ids:
                echo_texts[index] = echo  # (vLLM: with return_token_ids, not in the text)
            if prompt is not None:
                echoed[index] = prompt
    mode = wire_mode(req, req.logprobs is not None)
    return PreparedCompletion(req, jobs, echo_texts, prompt_tokens, total, mode, echoed,
                              Totals(total))


def _logprobs(prep: PreparedCompletion, index: int, prompt: list, items: list[Position],
              assets: ModelAssets):
    """The choice's logprobs: the echoed prompt positions (if any) before `items`."""
    if prep.mode is None:
        return None
    echoed = prep.echoed.get(index)
    if echoed is not None and prompt:
        top_n = prep.request.logprobs or 0
        items = [
            prompt_position(entry, echoed.ids[0],
                            echoed.offsets[0 if entry is None else entry.position], top_n,
                            () if entry is None else prompt_context(echoed.ids, entry))
            for entry in prompt
        ] + items
    return completion_logprobs(items, assets.token_bytes, prep.mode)


def _token_ids(prep: PreparedCompletion, index: int, ids: list[int], *, first: bool) -> dict:
    """return_token_ids (vLLM's): the prompt's ids in a choice's first chunk (or its whole
    response), and the generated ids each chunk carries."""
    if not prep.request.return_token_ids:
        return {}
    prompt = {"prompt_token_ids": list(prep.jobs[index].prompt_ids)} if first else {}
    return {**prompt, "token_ids": list(ids)}


async def complete(prep: PreparedCompletion, engine: EngineClient, assets: ModelAssets) -> dict:
    """The whole response; raises EngineError (or another error) after admission."""
    totals, tb = prep.totals, assets.token_bytes
    prompts = {job.index: job.prompt_ids for job in prep.jobs}
    outcomes = await collect(prep.jobs, engine, assets, totals, prep.echo_texts)
    choices = [{
        "index": out.index,
        "text": out.text,
        "logprobs": _logprobs(prep, out.index, out.prompt, out.positions, assets),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "prompt_logprobs": request_prompt_logprobs(prep.request, out.prompt, tb,
                                                   prompts[out.index]),
        **_token_ids(prep, out.index, out.token_ids, first=True),
    } for out in outcomes]
    return {
        **envelope("cmpl", "text_completion", assets),
        "choices": choices,
        "usage": totals.usage(),
        "system_fingerprint": None,
    }


def stream_completion(
    prep: PreparedCompletion, engine: EngineClient, assets: ModelAssets
) -> AsyncIterator[dict[str, Any]]:
    """Chunk objects (the caller encodes them as SSE, adds errors and [DONE])."""

    scored = prep.request.prompt_logprobs is not None
    started: set[int] = set()
    prompts = {job.index: job.prompt_ids for job in prep.jobs}

    def choice(index: int, text: str, delta: Delta) -> dict[str, Any]:
        body = {
            "index": index,
            "text": text,
            "logprobs": _logprobs(prep, index, delta.prompt, delta.positions, assets),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if scored:
            scores = request_prompt_logprobs(prep.request, delta.prompt, assets.token_bytes,
                                             prompts[index])
            body["prompt_logprobs"] = scores or None
        body.update(_token_ids(prep, index, delta.token_ids, first=index not in started))
        started.add(index)
        return body

    return stream_chunks(
        prep.jobs, engine, assets, id_prefix="cmpl", obj="text_completion",
        options=prep.request.stream_options, totals=prep.totals,
        prompt_tokens=prep.prompt_tokens, choice=choice, prefixes=prep.echo_texts,
    )
