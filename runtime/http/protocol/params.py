"""Request fields -> one SamplingParams per choice, and the endpoint-level checks that open
each request (every refusal is a RequestError naming the field: HTTP 400 before admission)."""

from __future__ import annotations

import re
from collections.abc import Callable

from helios_logprobs.ranks.contract.requests import RequestError, context_overflow
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.http.protocol.defaults import SamplingDefaults
from helios_logprobs.runtime.http.protocol.models import (
    MAX_CHOICES,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    SamplingFields,
)
from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.structured.request_fields import request_spec as output_constraint
from helios_logprobs.runtime.structured.spec import StructuredSpec

LOGIT_BIAS_LIMIT = 100.0
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}", re.ASCII)
"""A logit_bias key: ASCII digits only (`int` would also take "١", " 5", "+5" or "5_0")."""


def parse_logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    bad = [key for key in raw if not TOKEN_ID_KEY.fullmatch(key)]
    if bad:
        # Every offending key at once, as vLLM reports them.
        shown = [key if len(key) <= 32 else key[:32] + "..." for key in bad[:8]]
        listed = ", ".join(repr(key) for key in shown) + (", ..." if len(bad) > 8 else "")
        noun = "key" if len(bad) == 1 else "keys"
        raise RequestError("logit_bias", f"{noun} {listed}: not token ids (ASCII digits)")
    pairs: dict[int, float] = {}
    for key, bias in raw.items():
        token_id = int(key)
        if token_id in pairs:
            raise RequestError("logit_bias", f"token id {token_id} appears more than once")
        pairs[token_id] = min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return tuple(pairs.items())


def check_stops(stops: list[str]) -> None:
    if any(not stop for stop in stops):
        raise RequestError("stop", "stop cannot contain an empty string.")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if len(stop) > MAX_STOP_LENGTH:
            raise RequestError("stop", f"stop strings are limited to {MAX_STOP_LENGTH} characters")


def check_choices(n: int, prompts: int) -> None:
    if n * prompts > MAX_CHOICES:
        raise RequestError("n", f"n times the number of prompts must be at most {MAX_CHOICES}")


def build_params(
    req: SamplingFields,
    defaults: SamplingDefaults,
    *,
    max_tokens: int,
    logprobs: int | None,
    logprob_token_ids: list[int] | None,
    seed: int | None,
    prompt_logprobs: int | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    stop_token_entry: bool = False,
    structured: StructuredSpec | None = None,
) -> SamplingParams:
    """SamplingParams for one choice (its __post_init__ raises RequestError naming the field).
    A field the request leaves unset takes the model's default (`defaults`), else vLLM's
    neutral one. `prompt_logprobs`: what the engine scores (None: the prompt is not scored).
    `stop_token_entry`: a scoring request, whose terminating stop token has an entry.
    `structured`: a constraint the endpoint adds (a forced tool call); the request's own
    response_format / structured_outputs are parsed here (runtime/structured)."""
    allowed = None
    if req.allowed_token_ids is not None:
        allowed = tuple(dict.fromkeys(req.allowed_token_ids))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=effective_temperature(req, defaults),
        top_p=_first(req.top_p, defaults.top_p, 1.0),
        top_k=_first(req.top_k, defaults.top_k, 0),
        min_p=_first(req.min_p, defaults.min_p, 0.0),
        seed=seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_first(req.repetition_penalty, defaults.repetition_penalty, 1.0),
        logit_bias=parse_logit_bias(req.logit_bias),
        allowed_token_ids=allowed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        bad_words=bad_words,
        logprobs=None if logprob_token_ids is not None else logprobs,
        logprob_token_ids=None if logprob_token_ids is None else tuple(logprob_token_ids),
        prompt_logprobs=prompt_logprobs,
        thinking_token_budget=req.thinking_token_budget,
        speculative=req.speculative,
        stop_token_entry=stop_token_entry,
        return_entropy=req.return_entropy,
        structured=output_constraint(req.response_format, req.structured_outputs, structured),
    )


def _first(*values):
    return next(v for v in values if v is not None)


def effective_temperature(req: SamplingFields, defaults: SamplingDefaults) -> float:
    return _first(req.temperature, defaults.temperature, 1.0)


def capped_max_tokens(max_tokens: int, defaults: SamplingDefaults) -> int:
    """vLLM's rule: the model's max_new_tokens caps every request, explicit or not."""
    cap = defaults.max_tokens
    return max_tokens if cap is None else min(max_tokens, cap)


def bad_word_ids(words: list[str] | None, encode: Callable[[str], list[int]]
                 ) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as written (left-stripped), and with one
    leading space when that gives a different first token in as many tokens (a word in the
    middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words or ():
        plain = encode(word.lstrip())
        if not plain:
            raise RequestError("bad_words", f"the bad word {word!r} has no tokens")
        out.append(tuple(plain))
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)


def truncation(req: SamplingFields, max_model_len: int) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps (-1: the context length), or None
    for no truncation; vLLM's bound: at most max_model_len."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == 0:
        raise RequestError("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1 (or -1 "
                                                     "for the context length), got 0")
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise RequestError("truncate_prompt_tokens",
                           f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                           f"({max_model_len}). Please request a smaller truncation size.")
    return keep


def truncate(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """The prompt's last `keep` ids (truncation_side "left", the default) or its first."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep:]


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request uses seed + i (so n > 1 choices differ). -1 asks for no
    seed, as in vLLM (SamplingParams.__post_init__)."""
    return None if seed is None or seed == -1 else seed + index


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    param: str,
    *,
    default: int | None = None,
    allow_zero: bool = False,
    prompt_param: str = "prompt",
) -> int:
    """The request's max_tokens; 400 when it does not fit the context (vLLM's rule). Without
    one: `default` (clipped to the room left), else all of the room left."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(prompt_param, context_overflow(prompt_len, requested or 0,
                                                          max_model_len))
    if requested is None:
        return room if default is None else min(default, room)
    if requested < (0 if allow_zero else 1):
        raise RequestError(
            param, f"{param} must be at least {0 if allow_zero else 1}, got {requested}."
        )
    if requested > room:
        raise RequestError(param, f"'{param}' is too large: {requested}. "
                                  + context_overflow(prompt_len, requested, max_model_len))
    return requested


def check_request(req: SamplingFields, defaults: SamplingDefaults) -> None:
    """What vLLM's request model refuses (its validators, in their wording), the field
    policy's refusals (protocol.REFUSED), then vLLM's SamplingParams bounds."""
    options = req.stream_options
    if options is not None and (options.model_fields_set or options.model_extra) and not req.stream:
        # ({} asks for nothing, so vLLM lets it through)
        raise RequestError("stream_options",
                           "Stream options can only be defined when `stream=True`.")
    plp = req.prompt_logprobs
    if plp is not None and req.stream and (plp > 0 or plp == -1):
        raise RequestError("prompt_logprobs",
                           "`prompt_logprobs` are not available when `stream=True`.")
    if req.cache_salt is not None and not req.cache_salt:
        raise RequestError("cache_salt",
                           "Parameter 'cache_salt' must be a non-empty string if provided.")
    refused = req.refusal()
    if refused is not None:
        raise refused
    check_sampling(req, defaults)


def check_sampling(req: SamplingFields, defaults: SamplingDefaults) -> None:
    """vLLM's SamplingParams._verify_args bounds that the engine does not own (the engine
    checks top-p, top-k, min-p and the rest once, for every client)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise RequestError(name, f"{name} must be in [-2, 2], got {value}.")
    t = req.temperature  # (the engine refuses a negative one)
    if t is not None and t > 2.0:
        raise RequestError("temperature", f"temperature must be in [0, 2], got {t}.")
    if req.stream_interval is not None and req.stream_interval < 1:
        raise RequestError("stream_interval",
                           f"stream_interval must be at least 1, got {req.stream_interval}.")
    if req.bad_words is not None and any(not word for word in req.bad_words):
        raise RequestError("bad_words", "bad_words cannot contain an empty string. "
                                        f"Got bad_words={req.bad_words}")
    # Only 0 is greedy: a lower temperature than 0.01 samples at 0.01 (vLLM's floor,
    # SamplingParams.sampled_temperature).
    if req.n > 1 and effective_temperature(req, defaults) == 0:
        raise RequestError("n", f"n must be 1 when using greedy sampling, got {req.n}.")


def wire_mode(req: SamplingFields, enabled: bool) -> WireMode | None:
    """None: no logprobs requested."""
    if not enabled:
        return None
    return WireMode(req.logprob_token_ids is not None, bool(req.return_tokens_as_token_ids),
                    req.return_entropy)
