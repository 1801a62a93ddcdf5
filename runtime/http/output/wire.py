"""Pure builders for vLLM's logprobs wire format (Completions and Chat Completions).

Values: a logprob of -inf becomes -9999.0 (OpenAI's "very unlikely"), finite values are sent
exactly (vLLM clamps with max(x, -9999.0), which also floors finite values), and NaN or +inf
raise NonFiniteLogprob: `max(nan, -9999.0)` is NaN in Python, so a clamp alone would let NaN
reach JSON.

Tokens: the `token` text is the token's own bytes decoded with errors="replace" (leading spaces
kept), or "token_id:N" with return_tokens_as_token_ids. A text ending in U+FFFD (the token holds
part of a character) is decoded after the position's context, the up to 4 tokens sampled before
it, as vLLM corrects it (TokenBytes.token_string_after): "" while the character is unfinished,
the whole character on the token that completes it; each alternative after the same context.
Chat `bytes` are always the token's true bytes (vLLM re-encodes the corrected string, so a
character's bytes all go to its last token; with token-id mode it sends the placeholder's).

Completions `top_logprobs` maps token text -> logprob. Natural mode: the chosen token first,
then the natural alternatives by rank (chosen not repeated), as vLLM orders its dict.
Selected-ID mode (logprob_token_ids): exactly the selected ids in caller order. Two ids with the
same text would collide in vLLM's dict and one entry would silently vanish; here every later
colliding id is keyed "token_id:N" (and if such a key is itself taken, the whole position uses
"token_id:N" keys), so each id always has an entry.

Chat `top_logprobs`: the natural top-N by rank (or the selected ids in caller order). vLLM
instead takes the first N items of a dict that starts with the sampled token, so when the
sampled token is outside the top N it shows it plus only N-1 alternatives; ours never inserts
the chosen token. Chat positions without a logprob (forced tokens) have no entry.

Streaming: call the builders on each chunk's positions only. Offsets are absolute (they come
from the detokenizer, plus `offset_base`, e.g. the prompt text length under echo), so chunked
and whole responses agree.

Prompt scores (vLLM's `prompt_logprobs`): a list with null for prompt position 0 (no context),
then per position a dict token id (a string, as JSON keys are) -> {"logprob", "rank",
"decoded_token"}: the prompt token first, then the natural top-N by rank without repeating it
(N or N + 1 entries, as vLLM's dict). `rank` is 1 + the number of vocabulary ids with a
strictly greater logprob (the prompt token's comes from the engine; an alternative's is
computed from the ones before it in the natural top-N, which hold every greater value; vLLM
numbers alternatives 1..N, the same except among equal values). `decoded_token` is the token
text as above ("token_id:N" with return_tokens_as_token_ids). Echo with logprobs reports the
prompt positions as Completions positions: `Position(id, None)` for position 0, else the prompt
token's logprob with the first `logprobs` natural alternatives (`prompt_position`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from helios_logprobs.runtime.http.protocol.wire_mode import WireMode
from helios_logprobs.runtime.outputs import (
    GeneratedToken,
    PromptLogprob,
    TokenLogprob,
    TokenLogprobs,
)
from helios_logprobs.runtime.text.token_bytes import MAX_CONTEXT, TokenBytes, token_id_string

WIRE_FLOOR = -9999.0


class NonFiniteLogprob(ValueError):
    """A NaN or +inf logprob reached the wire builders."""


def wire_logprob(value: float) -> float:
    if value == -math.inf:
        return WIRE_FLOOR
    if not math.isfinite(value):
        raise NonFiniteLogprob(f"logprob {value!r} cannot be sent as JSON")
    return float(value)


_NEG_INF = -math.inf


def wire_logprobs(values: Iterable[float]) -> list[float]:
    """`wire_logprob` of each value, in one pass (the first non-finite one raises)."""
    out = list(map(float, values))
    if math.isfinite(sum(out)):  # (a sum is finite only when every term is)
        return out
    out = [WIRE_FLOOR if value == _NEG_INF else value for value in out]
    if not all(map(math.isfinite, out)):
        bad = next(value for value in out if not math.isfinite(value))
        raise NonFiniteLogprob(f"logprob {bad!r} cannot be sent as JSON")
    return out


@dataclass(frozen=True)
class Position:
    """One reported position. For echo, prompt position 0 is Position(id, None)."""

    token_id: int
    logprob: float | None
    alternatives: Sequence[TokenLogprob] = ()
    text_offset: int = 0
    context: tuple[int, ...] = ()
    """The up to 4 tokens sampled before this one, oldest first: what a partial character's
    text is decoded after."""
    entropy: float | None = None
    """GeneratedToken.entropy (return_entropy); None for prompt positions."""

    @classmethod
    def generated(cls, token: GeneratedToken, text_offset: int,
                  context: tuple[int, ...] = ()) -> Position:
        return cls(token.token_id, token.logprob, token.alternatives, text_offset, context,
                   token.entropy)


def wire_entropy(value: float | None) -> float | None:
    """An entropy as sent (exact FP32 as a JSON number); None stays null (no entry)."""
    if value is None:
        return None
    if not math.isfinite(value):
        raise NonFiniteLogprob(f"entropy {value!r} cannot be sent as JSON")
    return float(value)


def positions(
    entries: Iterable[tuple[GeneratedToken, int]], offset_base: int = 0, *,
    logprobs: bool = False, contexts: Mapping[int, tuple[int, ...]] | None = None,
) -> list[Position]:
    """Positions from (token, offset) entries, e.g. `stops.Chunk.entries`. For a request
    with logprobs, a forced token (no logprob: a thinking budget's end string) has no entry
    in any format. `contexts`: each token's context by its generated index."""
    contexts = contexts or {}
    return [Position.generated(tok, offset + offset_base, contexts.get(tok.index, ()))
            for tok, offset in entries if not (logprobs and tok.logprob is None)]


def token_text(tb: TokenBytes, token_id: int, mode: WireMode,
               context: Sequence[int] | None = ()) -> str:
    """The token's wire text after `context`; None: its own text, uncorrected (vLLM decodes
    an echoed prompt's first token, which has no logprob, alone)."""
    if mode.as_token_ids:
        return token_id_string(token_id)
    if context is None:
        return tb.token_string(token_id)
    return tb.token_string_after(token_id, context)


def _keys(tb: TokenBytes, ids: list[int], mode: WireMode, context: Sequence[int]) -> list[str]:
    if mode.as_token_ids:
        return [token_id_string(i) for i in ids]
    texts = tb.token_strings_after(ids, context)
    if len(set(texts)) == len(texts):
        return texts
    keys: list[str] = []
    seen: set[str] = set()
    for token_id, key in zip(ids, texts, strict=True):
        key = token_id_string(token_id) if key in seen else key
        keys.append(key)
        seen.add(key)
    if len(seen) != len(keys):
        return [token_id_string(i) for i in ids]
    return keys


def top_logprobs_dict(
    position: Position, tb: TokenBytes, mode: WireMode = WireMode()
) -> dict[str, float] | None:
    """The Completions top_logprobs entry of one position (None without a logprob)."""
    if position.logprob is None:
        return None
    alternatives = TokenLogprobs.of(position.alternatives)
    ids, values = alternatives.ids, alternatives.values
    chosen = position.token_id
    if not mode.selected:  # the chosen token first, not repeated among the natural ones
        at = ids.index(chosen) if chosen in ids else len(ids)
        ids = [chosen, *ids[:at], *ids[at + 1:]]
        values = [position.logprob, *values[:at], *values[at + 1:]]
    return dict(zip(_keys(tb, ids, mode, position.context), wire_logprobs(values), strict=True))


def completion_logprobs(
    items: Iterable[Position], tb: TokenBytes, mode: WireMode = WireMode()
) -> dict[str, Any]:
    """Completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    if mode.entropy:
        out["entropy"] = []
    for position in items:
        value = position.logprob
        context = None if value is None else position.context
        out["tokens"].append(token_text(tb, position.token_id, mode, context))
        out["token_logprobs"].append(None if value is None else wire_logprob(value))
        out["top_logprobs"].append(top_logprobs_dict(position, tb, mode))
        out["text_offset"].append(position.text_offset)
        if mode.entropy:
            out["entropy"].append(None if value is None else wire_entropy(position.entropy))
    return out


def chat_token_logprob(
    position: Position, tb: TokenBytes, mode: WireMode = WireMode()
) -> dict[str, Any]:
    """One Chat `logprobs.content[]` entry."""
    if position.logprob is None:
        raise ValueError(f"token {position.token_id} has no logprob (forced): no chat entry")
    alternatives = TokenLogprobs.of(position.alternatives)
    ids = [position.token_id, *alternatives.ids]
    values = wire_logprobs([position.logprob, *alternatives.values])
    texts = ([token_id_string(i) for i in ids] if mode.as_token_ids
             else tb.token_strings_after(ids, position.context))
    items = [
        {"token": text, "logprob": value, "bytes": [*raw]}
        for text, value, raw in zip(texts, values, tb.bytes_of_each(ids), strict=True)
    ]
    item = items[0]
    item["top_logprobs"] = items[1:]
    if mode.entropy:
        item["entropy"] = wire_entropy(position.entropy)
    return item


def chat_logprobs(
    items: Iterable[Position], tb: TokenBytes, mode: WireMode = WireMode()
) -> dict[str, Any]:
    """Chat `logprobs`: {"content": [...]}; positions without a logprob are left out."""
    return {
        "content": [
            chat_token_logprob(position, tb, mode)
            for position in items
            if position.logprob is not None
        ]
    }


# ----------------------------------------------------------------------------- prompt scores
def natural_ranks(alternatives: Sequence[TokenLogprob]) -> list[int]:
    """1 + the number of strictly greater values, for a natural top-N (value desc, id asc):
    every greater value of the vocabulary is among the earlier alternatives."""
    ranks: list[int] = []
    for i, alt in enumerate(alternatives):
        if i and alt.logprob == alternatives[i - 1].logprob:
            ranks.append(ranks[-1])
        else:
            ranks.append(i + 1)
    return ranks


def prompt_logprobs_entry(
    entry: PromptLogprob | None, tb: TokenBytes, top_n: int, mode: WireMode = WireMode(),
    context: Sequence[int] = (),
) -> dict[str, dict[str, Any]] | None:
    """vLLM's prompt_logprobs item for one prompt position (None: position 0). The prompt
    token first, then the first `top_n` natural alternatives without repeating it.
    `context`: the prompt tokens before it (prompt_context)."""
    if entry is None:
        return None

    def item(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": wire_logprob(logprob), "rank": rank,
                "decoded_token": token_text(tb, token_id, mode, context)}

    out = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
    alternatives = entry.alternatives[:top_n]
    for alt, rank in zip(alternatives, natural_ranks(alternatives), strict=True):
        if alt.token_id != entry.token_id:
            out[str(alt.token_id)] = item(alt.token_id, alt.logprob, rank)
    return out


def prompt_logprobs_list(
    entries: Iterable[PromptLogprob | None], tb: TokenBytes, top_n: int,
    mode: WireMode = WireMode(), prompt_ids: Sequence[int] = (),
) -> list[dict[str, dict[str, Any]] | None]:
    """`prompt_ids`: the request's prompt (each position's text context)."""
    return [prompt_logprobs_entry(entry, tb, top_n, mode,
                                  prompt_context(prompt_ids, entry) if entry else ())
            for entry in entries]


def prompt_context(prompt_ids: Sequence[int], entry: PromptLogprob) -> tuple[int, ...]:
    """A prompt position's context: the up to 4 prompt tokens before it, position 0 excepted
    (it has no prompt logprob entry, so vLLM never counts it). From the prompt itself, so a
    stream's later scored chunks see the tokens of the earlier ones."""
    return tuple(prompt_ids[max(1, entry.position - MAX_CONTEXT):entry.position])


def request_prompt_logprobs(
    req: Any, entries: Iterable[PromptLogprob | None], tb: TokenBytes,
    prompt_ids: Sequence[int],
) -> list[dict[str, dict[str, Any]] | None] | None:
    """A request's `prompt_logprobs` field (None when it asked for none): its top-N and
    return_tokens_as_token_ids (a Completions or Chat request model)."""
    if req.prompt_logprobs is None:
        return None
    mode = WireMode(as_token_ids=bool(req.return_tokens_as_token_ids))
    return prompt_logprobs_list(entries, tb, req.prompt_logprobs, mode, prompt_ids)


def prompt_position(
    entry: PromptLogprob | None, first_token: int, text_offset: int, top_n: int,
    context: tuple[int, ...] = (),
) -> Position:
    """A prompt position as a Completions position (echo with logprobs): position 0 (None)
    has no logprob; others carry the first `top_n` natural alternatives."""
    if entry is None:
        return Position(first_token, None, (), text_offset)
    return Position(entry.token_id, entry.logprob, entry.alternatives[:top_n], text_offset,
                    context)
