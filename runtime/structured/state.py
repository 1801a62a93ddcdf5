"""One constrained request's matcher on the engine core, and the bitmasks of its rows.

The matcher follows the committed tokens: before each plan it accepts the tokens the request
emitted since the last one (``sync``), so it never needs to know which speculative
proposals a step accepted. A speculative round's rows are masked from tentative states: row
0 from the committed state, row i after the proposals p1..pi; the proposals are accepted
tentatively and rolled back at once. A proposal the grammar rejects (or a stop token) ends
the round there: the target's masked row could never equal it, so the rows after it would
never be emitted.

A bitmask row is xgrammar's: int32 words, bit j of word w set when token 32 w + j is
allowed, for the whole (padded) vocabulary; each rank applies its own shard's slice of it
(ranks/grammar_mask.py). Once the matcher has accepted a stop token the grammar is over and
the request's rows are unconstrained, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr


class GrammarViolation(RuntimeError):
    """A committed token that the request's grammar does not accept."""


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.consumed = 0
        """How many of the request's generated tokens the matcher has accepted."""
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def sync(self, generated: Sequence[int]) -> None:
        """Accept the tokens committed since the last call; GrammarViolation for one the
        grammar does not allow."""
        for token in generated[self.consumed:]:
            if self.matcher.is_terminated():
                break  # (past the grammar's end: unconstrained)
            if not self.matcher.accept_token(token):
                raise GrammarViolation(
                    f"token {token} at generated position {self.consumed} does not match the "
                    f"request's grammar")
            self.consumed += 1
        self.consumed = len(generated)

    def round(self, generated: Sequence[int], proposals: Sequence[int] = ()
              ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """(the proposals kept, one bitmask row per sampling row: 1 + kept) for the next
        decode of a request that has emitted ``generated``; no masks once the grammar has
        ended."""
        self.sync(generated)
        if self.matcher.is_terminated():
            return tuple(proposals), ()
        masks = [self._fill()]
        taken = 0
        for token in proposals:
            # (the row just filled says whether the grammar takes the proposal: no matcher
            # call, and no xgrammar warning, for the many proposals it rejects)
            if token in self.stop_token_ids or not self._allows(token):
                break
            if not self.matcher.accept_token(token):
                break
            taken += 1
            masks.append(self._fill())
        if taken:
            self.matcher.rollback(taken)
        return tuple(proposals[:taken]), tuple(masks)

    def _allows(self, token: int) -> bool:
        """Whether the last filled row allows ``token``."""
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self._bitmask[0, token >> 5]) >> (token & 31)) & 1)

    def _fill(self) -> bytes:
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0].numpy().tobytes()
