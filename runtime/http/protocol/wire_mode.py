"""How a request's logprobs are written on the wire: shared by the request side (params.py
builds it from the fields) and the output side (output/wire.py writes with it)."""

from __future__ import annotations

from dataclasses import dataclass

from helios_logprobs.runtime.engine.client import SamplingParams


@dataclass(frozen=True)
class WireMode:
    selected: bool = False
    """logprob_token_ids mode: alternatives are the caller's ids, not natural ones."""
    as_token_ids: bool = False
    """return_tokens_as_token_ids: every token text is "token_id:N"."""
    entropy: bool = False
    """return_entropy: each generated position's entropy beside its logprob."""

    @classmethod
    def for_params(cls, params: SamplingParams, *, as_token_ids: bool = False) -> WireMode:
        return cls(params.logprob_token_ids is not None, as_token_ids, params.return_entropy)
