"""Verification of speculative rounds on the target's own, vocabulary-sharded logits.

A round of slot s feeds (last token, p1..pN) at consecutive positions; its N + 1 logit rows
are contiguous (packed targets) and row i holds the target's logits for generated position
g + i, g = len(output) before the round. Verification samples every row through the same
``ShardedSampler.sample`` as ordinary decoding, with row i's ``RowSampling.position`` = g + i
(Philox noise keyed by the request seed and that position, counter = the global token id)
and row i's output history = output + p1..pi (the tokens accepted before position g + i, if
the round gets that far), so penalties see exactly what ordinary decoding would have seen.
The commit (ranks/commit.py, ``RecordBatch.emit``) accepts p(i+1) exactly when it equals row
i's target token; the first mismatch emits the target's token. Hence a greedy or seeded
request emits the same tokens with speculation on and off, at every TP degree.

Agreement without a broadcast: the sampler is an identical sharded computation on every
rank (the same plan, the same fixed-width exchanges of each shard's candidates, the same
global pick), so every rank holds the same target tokens, and the commit, a pure function of
those tokens and the plan, writes the same records on every rank. The acceptance decision
is therefore agreed by construction before the commit, and the logprob writer (ranks/step/
reduce.py), which runs after the commit, gates each row on those committed records.

No draft model exists: proposals come from the request's own history on the coordinator
(runtime/engine/proposer.py) and have no probabilities, so nothing but the target's logits
can reach the reporting path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from helios_logprobs.ranks.commit import SlotState
from helios_logprobs.ranks.sampler.params import RowSampling


class Round(Protocol):
    """A sampling work item as the step prepares it (ranks.step.inputs.SampleRow)."""

    slot: int
    state: SlotState
    first_row: int
    proposals: tuple[int, ...]


def sampler_rows(
    rounds: Sequence[Round], grammar_masks: Mapping[int, Sequence[bytes]] | None = None,
) -> tuple[list[RowSampling], list[Sequence[int]], list[Sequence[int]]]:
    """The sampler's per-row arguments (parameters, prompt, output history) for every row
    of ``rounds``, in row order; an ordinary sample is a round without proposals.
    ``grammar_masks``: slot -> the bitmask row of each of its rows (SlotWork.grammar_masks)."""
    params: list[RowSampling] = []
    prompts: list[Sequence[int]] = []
    histories: list[Sequence[int]] = []
    for item in rounds:
        state = item.state
        sampling = state.spec.sampling
        base = len(state.output)
        masks = (grammar_masks or {}).get(item.slot)
        for i in range(1 + len(item.proposals)):
            if masks:
                params.append(replace(sampling, position=base + i, grammar_bitmask=masks[i]))
            else:
                params.append(replace(sampling, position=base + i))
            prompts.append(state.prompt)
            if i and (sampling.penalized or sampling.bad_words):
                histories.append([*state.output, *item.proposals[:i]])
            else:
                histories.append(state.output)  # unread by an unpenalized row
    return params, prompts, histories


def split_rows(rounds: Sequence[Round], tokens: Sequence[int]) -> list[Sequence[int]]:
    """The sampled tokens of each round's rows (``tokens`` in row order)."""
    return [tokens[r.first_row : r.first_row + 1 + len(r.proposals)] for r in rounds]
