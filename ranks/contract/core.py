"""The core a rank exports: its declared buffers and graphs, validated once at load."""

from __future__ import annotations

from helios_logprobs.ranks.contract import declarations as d
from helios_logprobs.ranks.contract.completion import CompletionOutputs

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


def capabilities(
    outputs: CompletionOutputs,
    logprobs: bool,
    scored: tuple[tuple[d.BufferDecl, ...], ...] = (),
) -> d.LogprobCapabilities:
    """Validate the core's declarations (malformed ones fail loading) and return K.

    ``scored``: each scored capacity's (prompt_logprobs, prompt_target_tokens) declarations;
    every capacity is validated with its scored_prefill graph. The capabilities report the
    largest capacity.
    """
    decl = core_declarations(outputs, logprobs)
    caps = d.validate(decl, outputs.capacity, outputs.token_capacity)
    for buffers in scored:
        rows = buffers[-1].shape[0]
        graph = d.GraphDecl(f"scored_prefill_{rows}", d.SCORED_PREFILL,
                            (d.PROMPT_TARGET_TOKENS,), (d.PROMPT_LOGPROBS,))
        rung = d.CoreDeclarations((*decl.buffers, *buffers), (*decl.graphs, graph))
        caps = d.validate(rung, outputs.capacity, outputs.token_capacity)
    return caps
