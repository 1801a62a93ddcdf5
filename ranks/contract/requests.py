"""The one validation path for what a request asks of the core, and its typed error.

The engine and both HTTP endpoints call these checks; every refusal is a ``RequestError``
carrying the parameter's name (the server answers HTTP 400 naming it, before admission).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS

LOGPROBS = "logprobs"
TOKEN_IDS = "logprob_token_ids"
PROMPT_LOGPROBS = "prompt_logprobs"


class RequestError(ValueError):
    """A request the core refuses before admission; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def context_overflow(input_tokens: int, output_tokens: int, max_model_len: int) -> str:
    """vLLM's words for a request that does not fit the context (clients parse them: "You
    passed N input tokens", "context length is only C tokens")."""
    return (
        f"You passed {input_tokens} input tokens and requested {output_tokens} output tokens. "
        f"However, the model's context length is only {max_model_len} tokens, resulting in a "
        f"maximum input length of {max(max_model_len - output_tokens, 0)} tokens. Please reduce "
        f"the length of the input prompt. (parameter=input_tokens, value={input_tokens})"
    )


def check_prompt_logprobs(value: int | None, k: int, enabled: bool, vocab_size: int) -> None:
    """prompt_logprobs: None, or 0..K on a core that scores prompts (--prompt-logprobs)."""
    if value is None:
        return
    if not enabled:
        raise RequestError(
            PROMPT_LOGPROBS,
            "prompt logprobs need a server started with --prompt-logprobs (this one has no "
            "prompt scoring buffers)",
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(PROMPT_LOGPROBS, f"must be an integer in [0, {k}], got {value!r}")
    check_count(PROMPT_LOGPROBS, "prompt", value, k, vocab_size)


def check_count(param: str, kind: str, value: int, k: int, vocab_size: int) -> None:
    """0 <= value <= K, refused in vLLM's words. -1 asks vLLM for the whole vocabulary, which
    no core here serves (K is at most 20)."""
    if value < 0 and value != -1:
        raise RequestError(param, f"`{param}` must be a positive value or -1.")
    wanted = vocab_size if value == -1 else value
    if wanted > k:
        raise RequestError(param, f"Requested {kind} logprobs of {wanted}, which is greater "
                                  f"than max allowed: {k}")
    if value == -1:
        raise RequestError(param, f"`{param}` -1 (the whole vocabulary) is not served here; "
                                  f"ask for 0..{k}")


def check_min_tokens(min_tokens: object, max_tokens: int) -> None:
    """0 <= min_tokens <= max_tokens (vLLM's wording)."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise RequestError("min_tokens", f"min_tokens must be greater than or equal to 0, "
                                         f"got {min_tokens!r}")
    if min_tokens > max_tokens:
        raise RequestError("min_tokens", f"min_tokens must be less than or equal to "
                                         f"max_tokens={max_tokens}, got {min_tokens}")


def check_token_ids(param: str, ids: Iterable[object], vocab_size: int) -> None:
    """Token ids must be ints (not bool) inside [0, vocab_size)."""
    ids = list(ids)
    not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
    if not_ints:
        raise RequestError(param, f"ids must be integers, got {not_ints[:8]}")
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(
            param, f"ids {outside[:8]} are out of vocabulary: an id must be greater than or "
            f"equal to 0 and less than {vocab_size}"
        )


def check_token_ids_given(token_ids: object) -> None:
    """vLLM refuses an empty `logprob_token_ids` before any rule that pairs it with logprobs."""
    if token_ids is not None and not token_ids:
        raise RequestError(TOKEN_IDS, "`logprob_token_ids` must not be an empty list.")


def check_logprob_request(
    logprobs: int | None,
    token_ids: Sequence[int] | None,
    vocab_size: int,
    k: int,
    supports_token_ids: bool,
    *,
    count_param: str = LOGPROBS,
) -> None:
    """Refuse what the core cannot serve: K=0 cores refuse all logprobs; 0 <= logprobs <= K;
    selected ids need the ID inputs and are 1..128 distinct vocabulary ids. ``count_param``
    names the field that carries the count (chat's ``top_logprobs``)."""
    if k == 0:
        if logprobs is not None or token_ids is not None:
            raise RequestError(
                LOGPROBS, "this model's core declares no logprob outputs (allow_logprobs: false)"
            )
        return
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise RequestError(count_param, f"must be an integer in [0, {k}], got {logprobs!r}")
        check_count(count_param, "sample", logprobs, k, vocab_size)
    if token_ids is None:
        return
    if not supports_token_ids:
        raise RequestError(
            TOKEN_IDS,
            "not supported: this model's core declares no token-id inputs "
            "(it serves natural alternatives only)",
        )
    check_token_ids_given(token_ids)
    if len(token_ids) > MAX_TOKEN_IDS:
        raise RequestError(TOKEN_IDS, f"must hold 1..{MAX_TOKEN_IDS} ids, got {len(token_ids)}")
    check_token_ids(TOKEN_IDS, token_ids, vocab_size)
    repeated = sorted({t for t in token_ids if token_ids.count(t) > 1})
    if repeated:
        raise RequestError(TOKEN_IDS, f"ids must be distinct, repeated: {repeated[:8]}")
