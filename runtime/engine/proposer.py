"""History proposals for speculative rounds: prompt lookup over a request's own tokens.

As vLLM's ``ngram`` method: the proposal for a request whose context (prompt + generated) is
c[0..L) is found by matching its suffix against earlier text. For n from ``ngram_max`` down
to ``ngram_min``, the earliest occurrence c[s:s+n] of the suffix c[L-n:L] (with s + n <=
L - 1, so a token follows it) proposes the tokens after it, c[s+n : s+n+k], at most k and
never past the end of the context. The longest matching n wins, and among its occurrences the
earliest (as vLLM's matcher picks; it leaves the most room for k tokens after the match); no
match proposes nothing and the request decodes ordinarily.

Cost: the proposer runs on the coordinator before each plan and never builds the context
(no prompt + output list, no array per step). Each request keeps one dict per n mapping an
n-gram (an exact integer key, 32 bits per token) to the start of its first occurrence; a new
token adds at most one entry per n (O(ngram_max^2) integer operations), and a proposal is at
most ngram_max - ngram_min + 1 dictionary lookups plus the k tokens it returns. The prompt is
indexed once, on the request's first proposal.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Context:
    """c[i] over a request's prompt and generated lists, without concatenating them."""

    __slots__ = ("prompt", "generated")

    def __init__(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        self.prompt = prompt
        self.generated = generated

    def __len__(self) -> int:
        return len(self.prompt) + len(self.generated)

    def __getitem__(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.generated[i - p]


def _key(context: _Context, start: int, n: int) -> int:
    key = 0
    for i in range(start, start + n):
        key = (key << 32) | context[i]
    return key


class _Index:
    """One request's n-gram tables: tables[n - ngram_min][key] = earliest start s."""

    __slots__ = ("tables", "indexed")

    def __init__(self, sizes: int) -> None:
        self.tables: list[dict[int, int]] = [{} for _ in range(sizes)]
        self.indexed = 0
        """Context length up to which every n-gram with a following token is indexed."""


class HistoryProposer:
    def __init__(self, tokens: int, ngram_min: int, ngram_max: int) -> None:
        if tokens < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {tokens}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.tokens = tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[int, _Index] = {}

    def propose(
        self, ordinal: int, prompt: Sequence[int], generated: Sequence[int], limit: int
    ) -> tuple[int, ...]:
        """Up to min(N, ``limit``) proposed next tokens of request ``ordinal``."""
        k = min(self.tokens, limit)
        if k < 1:
            return ()
        context = _Context(prompt, generated)
        index = self._indexes.get(ordinal)
        if index is None:
            index = self._indexes[ordinal] = _Index(self.ngram_max - self.ngram_min + 1)
        self._extend(index, context)
        length = len(context)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if length < n + 1:
                continue
            start = index.tables[n - self.ngram_min].get(_key(context, length - n, n))
            if start is not None:
                first = start + n
                return tuple(context[i] for i in range(first, min(first + k, length)))
        return ()

    def release(self, ordinal: int) -> None:
        """Forget a finished request's tables."""
        self._indexes.pop(ordinal, None)

    def _extend(self, index: _Index, context: _Context) -> None:
        """Index the n-grams c[s:s+n] followed by a token, s + n <= len - 1, not yet indexed:
        for each new last position j = s + n - 1 in [indexed - 1, len - 1)."""
        length = len(context)
        lo = self.ngram_min
        for end in range(max(index.indexed - 1, 0), length - 1):
            for n in range(lo, min(self.ngram_max, end + 1) + 1):
                start = end + 1 - n
                index.tables[n - lo].setdefault(_key(context, start, n), start)
        index.indexed = length
