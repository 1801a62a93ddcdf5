"""The core a rank exports: its declared buffers and graphs, validated once at load."""

from __future__ import annotations

from ranks import declarations as d
from ranks.completion import CompletionOutputs

SAMPLING_INPUTS = (d.LOGPROB_REQUESTED, d.LOGPROB_TOKEN_IDS, d.LOGPROB_TOKEN_ID_COUNTS)
OUTPUTS = (d.COMPLETION_RECORDS, d.COMPLETION_LOGPROBS)


def core_declarations(outputs: CompletionOutputs, logprobs: bool) -> d.CoreDeclarations:
    """The decode/mixed sampling graph and the prefill-only graph of this runtime.

    With ``logprobs`` False the core declares only its records (a core exported without the
    logprob bundle): it loads and serves with K=0. Otherwise it declares every buffer of
    ``outputs``; a bundle without the ID inputs (K < 20) binds only the flag vector.
    """
    if not logprobs:
        records = [b for b in outputs.declarations() if b.name == d.COMPLETION_RECORDS]
        graphs = (
            d.GraphDecl("decode", "sampling", (), (d.COMPLETION_RECORDS,)),
            d.GraphDecl("prefill", "prefill", (), ()),
        )
        return d.CoreDeclarations(tuple(records), graphs)
    declared = outputs.tensors()
    inputs = tuple(name for name in SAMPLING_INPUTS if name in declared)
    graphs = (
        d.GraphDecl("decode", "sampling", inputs, OUTPUTS),
        d.GraphDecl("prefill", "prefill", (), ()),
    )
    return d.CoreDeclarations(outputs.declarations(), graphs)


def capabilities(outputs: CompletionOutputs, logprobs: bool) -> d.LogprobCapabilities:
    """Validate the core's declarations (malformed ones fail loading) and return K."""
    decl = core_declarations(outputs, logprobs)
    return d.validate(decl, outputs.capacity, outputs.token_capacity)
