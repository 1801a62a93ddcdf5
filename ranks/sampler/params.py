"""Per-row sampling parameters, as the coordinator sends them in the step plan."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from helios_logprobs.ranks.contract.requests import RequestError

GREEDY_EPS = 1e-5
"""Temperatures below this sample greedily (vLLM's _SAMPLING_EPS)."""

SEED_MIN = -(2**63)
SEED_MAX = 2**64
POSITION_MAX = 2**32


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(name, f"expected a finite number, got {value!r}")
    return float(value)


def _token_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(name, f"expected a token id >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of one logit row.

    ``seed`` is required (the coordinator picks one for unseeded requests); it keys the
    Philox noise together with ``position``, the index of the generated token. ``top_k`` 0 or
    -1 disables top-k. ``logit_bias`` is a tuple of distinct (token id, bias) pairs (a mapping
    is accepted and converted); ``allowed_token_ids`` (the grammar mask) is None for no mask.
    While ``position < min_tokens`` the ids ``min_tokens_ids`` (the request's stop token ids:
    EOS unless ignored, and ``stop_token_ids``) cannot be sampled (vLLM's min_tokens).
    ``bad_words`` are token-id sequences (vLLM's bad_words): a sequence's last id cannot be
    sampled where the output so far ends with the rest of it (a one-id sequence: never).
    """

    seed: int
    position: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    grammar_bitmask: bytes | None = None
    """This row's structured-output mask (ranks/grammar_mask.py): xgrammar's bitmask row over
    the whole vocabulary, set per step by the coordinator; None: no grammar."""

    def __post_init__(self) -> None:
        for name in ("seed", "position", "top_k", "min_tokens"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise RequestError(name, f"expected an int, got {getattr(self, name)!r}")
        if not SEED_MIN <= self.seed < SEED_MAX:
            raise RequestError("seed", f"expected a 64-bit integer, got {self.seed}")
        if not 0 <= self.position < POSITION_MAX:
            raise RequestError("position", f"expected 0 <= position < 2**32, got {self.position}")
        if _finite("temperature", self.temperature) < 0:
            raise RequestError("temperature",
                               f"temperature must be non-negative, got {self.temperature}.")
        if self.top_k < -1:
            raise RequestError(
                "top_k", f"expected -1, 0 (off) or a positive count, got {self.top_k}"
            )
        if not 0 < _finite("top_p", self.top_p) <= 1:
            raise RequestError("top_p", f"expected 0 < top_p <= 1, got {self.top_p}")
        if not 0 <= _finite("min_p", self.min_p) <= 1:
            raise RequestError("min_p", f"expected 0 <= min_p <= 1, got {self.min_p}")
        _finite("presence_penalty", self.presence_penalty)
        _finite("frequency_penalty", self.frequency_penalty)
        if _finite("repetition_penalty", self.repetition_penalty) <= 0:
            raise RequestError("repetition_penalty", f"expected > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(_token_id("allowed_token_ids", t) for t in self.allowed_token_ids)
            if not allowed or len(set(allowed)) != len(allowed):
                raise RequestError("allowed_token_ids", "expected distinct ids, at least one")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.min_tokens < 0:
            raise RequestError("min_tokens", f"expected >= 0, got {self.min_tokens}")
        blocked = tuple(_token_id("min_tokens", t) for t in self.min_tokens_ids)
        object.__setattr__(self, "min_tokens_ids", blocked)
        if self.grammar_bitmask is not None and not isinstance(self.grammar_bitmask, bytes):
            raise RequestError("structured_outputs", "a grammar bitmask row is bytes")
        words = tuple(tuple(_token_id("bad_words", t) for t in w) for w in self.bad_words)
        if any(not w for w in words):
            raise RequestError("bad_words", "a bad word has no tokens")
        object.__setattr__(self, "bad_words", words)

    def banned_ids(self, output: Sequence[int]) -> list[int]:
        """The bad words' last ids that the output so far would complete (vLLM's
        apply_bad_words: the output ids only, not the prompt)."""
        banned = []
        for word in self.bad_words:
            prefix = len(word) - 1
            if not prefix or (len(output) >= prefix
                              and tuple(output[len(output) - prefix:]) == word[:-1]):
                banned.append(word[-1])
        return banned

    @property
    def blocked_ids(self) -> tuple[int, ...]:
        """Ids that cannot be sampled at this position (the stop ids before min_tokens)."""
        return self.min_tokens_ids if self.position < self.min_tokens else ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def unprocessed(self) -> bool:
        """Whether no logits processor changes the row (no grammar, allowed or blocked ids,
        bad words, logit bias or penalties)."""
        return not (self.allowed_token_ids is not None or self.blocked_ids or self.bad_words
                    or self.logit_bias or self.penalized or self.grammar_bitmask is not None)

    def top_k_active(self, vocab_size: int) -> bool:
        return 0 < self.top_k < vocab_size

    def filtered(self, vocab_size: int) -> bool:
        """Whether any of top-k, top-p, min-p changes the row (never for greedy rows)."""
        return not self.greedy and (
            self.top_k_active(vocab_size) or self.top_p < 1 or self.min_p > 0
        )

    def max_token_id(self) -> int:
        ids = [t for t, _ in self.logit_bias] + list(self.allowed_token_ids or ())
        ids += self.min_tokens_ids
        ids += [t for word in self.bad_words for t in word]
        return max(ids, default=-1)


def _bias_pairs(
    value: Mapping[int, float] | Iterable[tuple[int, float]],
) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    pairs = tuple((_token_id("logit_bias", t), _finite("logit_bias", b)) for t, b in items)
    if len({t for t, _ in pairs}) != len(pairs):
        raise RequestError("logit_bias", "token ids must be distinct")
    return pairs
