"""The reduction gate and payload write on host tensors (in C) against the same methods'
tensor-op form, which CUDA (and a CPU without a C compiler) runs: the same flags, chosen tokens,
selected IDs and payload words on randomized records (stale slots and epochs, every kind,
forced positions, positions past the emitted count, wrong logit rows, unrequested slots,
padding rows, tokens outside the vocabulary)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
from helios_logprobs.ranks.contract.abi6 import (
    EMITTED,
    EPOCH,
    FIRST_LOGIT_ROW,
    FORCED_MASK,
    HEADER,
    KIND,
    SLOT,
    Kind,
)
from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.step.gate_native import NativeStepGate, native_gate
from helios_logprobs.ranks.step.reduce import StepReduction

MODES = ("native", "tensor")
VOCAB = 2
"""The randomized records hold tokens 0..2: a third of them are outside this vocabulary."""


def reduction_over(outputs: CompletionOutputs, rows: int, mode: str) -> StepReduction:
    """A StepReduction's gate/write state for `rows` logit rows (no model or driver: the two
    methods under test read only these)."""
    step = StepReduction.__new__(StepReduction)
    step.outputs = outputs
    step.vocab_size = VOCAB
    step.rows = torch.arange(rows, dtype=torch.int64)
    step.kinds = torch.tensor([int(Kind.SAMPLE), int(Kind.SPECULATIVE)])
    step.chosen = torch.zeros(rows, dtype=torch.int64)
    step.requested = torch.zeros(rows, dtype=torch.int32)
    step.ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32)
    step.counts = torch.zeros(rows, dtype=torch.int32)
    step.out = torch.randint(-2**31, 2**31 - 1, (rows, PAYLOAD_WORDS), dtype=torch.int32)
    step.native = None
    if mode == "native":
        lib = native_gate()
        if lib is None:
            pytest.skip("no C compiler: the native gate is not built")
        step.native = NativeStepGate(lib, outputs, step.requested, step.chosen, step.ids,
                                     step.counts, step.out, VOCAB)
    return step


@pytest.mark.parametrize("seed", range(12))
def test_host_gate_and_write_equal_the_tensor_ops(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    capacity, tokens, rows = 9, 4, 10
    outputs = CompletionOutputs.allocate(capacity, tokens)
    records = outputs.completion_records
    records.copy_(torch.randint(0, 3, records.shape, generator=g))
    frame = seed % 2
    rec = records[frame]
    # Distinct slots, as a step's inputs give them; the last rows are padding (slot -1) and
    # only go through the gate.
    written = rows - 3
    row_slots = torch.full((rows,), -1)
    row_slots[:written] = torch.randperm(capacity, generator=g)[:written]
    row_positions = torch.randint(0, tokens, (rows,), generator=g)
    row_slots[written:] = -1
    row_positions[written:] = -1
    row_epochs = torch.randint(0, 2, (rows,), generator=g)
    for row in range(rows):  # make most rows plausible, so that many pass the gate
        slot = int(row_slots[row])
        if slot < 0 or torch.rand(1, generator=g) < 0.2:
            continue
        rec[slot, SLOT] = slot
        rec[slot, EPOCH] = row_epochs[row]
        rec[slot, KIND] = int([Kind.SAMPLE, Kind.SPECULATIVE, Kind.ADMISSION][row % 3])
        low = max(0, int(row_positions[row]))
        rec[slot, EMITTED] = int(torch.randint(low, tokens + 1, (1,), generator=g))
        forced = torch.rand(tokens, generator=g) < 0.25
        rec[slot, FORCED_MASK] = int(sum(1 << i for i in range(tokens) if forced[i]))
        rec[slot, FIRST_LOGIT_ROW] = row - max(0, int(row_positions[row]))
    outputs.logprob_requested.copy_((torch.rand(capacity, generator=g) < 0.8).int())
    outputs.logprob_token_ids.copy_(torch.randint(0, 100, (capacity, MAX_TOKEN_IDS),
                                                  generator=g))
    outputs.logprob_token_id_counts.copy_(torch.randint(0, 5, (capacity,), generator=g))
    outputs.completion_logprobs.copy_(torch.randint(-9, 9, outputs.completion_logprobs.shape,
                                                    generator=g))
    before = outputs.completion_logprobs.clone()
    results = []
    for mode in MODES:
        outputs.completion_logprobs.copy_(before)
        step = reduction_over(outputs, rows, mode)
        torch.manual_seed(seed)
        step.out.copy_(torch.randint(-2**31, 2**31 - 1, (rows, PAYLOAD_WORDS),
                                     dtype=torch.int32))
        step.gate(frame, row_slots, row_epochs, row_positions)
        step.write(frame, row_slots[:written], row_positions[:written])
        results.append((step.requested.clone(), step.chosen.clone(), step.ids.clone(),
                        step.counts.clone(), outputs.completion_logprobs.clone()))
    *hosts, tensor_ops = results
    assert bool(tensor_ops[0].any()), "the case should gate some rows"
    for host in hosts:
        for got, want in zip(host, tensor_ops, strict=True):
            assert torch.equal(got, want)
    assert not torch.equal(tensor_ops[4], before)
    assert torch.equal(tensor_ops[4][1 - frame], before[1 - frame])


def test_a_slot_outside_capacity_is_an_index_error() -> None:
    outputs = CompletionOutputs.allocate(4, 2)
    step = reduction_over(outputs, 3, "native")
    slots, epochs, positions = torch.tensor([0, 4, -1]), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(3, dtype=torch.int64)
    with pytest.raises(IndexError):
        step.gate(0, slots, epochs, positions)


@pytest.mark.parametrize(("vocab", "ties"), [(1031, False), (3000, True)])
def test_one_c_call_per_step_equals_gate_reduce_and_write(vocab: int, ties: bool) -> None:
    """At TP1 the gate, the compiled reduction and the write run in one C call: the payload
    frame equals the three calls' (tensor-op gate and write). Ties across the 20th value
    make the compiled launches leave rows to Python, which the step then reduces itself."""
    capacity, tokens, frame = 6, 2, 1
    model = SimpleNamespace(local_width=vocab, dtype=torch.bfloat16, vocab_start=0,
                            local_valid=vocab, vocab_size=vocab)
    g = torch.Generator().manual_seed(vocab)
    outputs = CompletionOutputs.allocate(capacity, tokens)
    slots = [4, 1, 3, 0, -1, -1]
    epochs = [2, 2, 2, 2, -1, -1]
    positions = [0, 0, 0, 0, -1, -1]
    records = outputs.completion_records[frame]
    for row, slot in enumerate(slots[:4]):
        records[slot, SLOT], records[slot, EPOCH], records[slot, KIND] = slot, 2, int(Kind.SAMPLE)
        records[slot, EMITTED], records[slot, FIRST_LOGIT_ROW] = 1, row
        records[slot, HEADER] = (17 * row + 3) % vocab
    outputs.logprob_requested.copy_(torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.int32))
    outputs.logprob_token_id_counts[0] = 2
    outputs.logprob_token_ids[0, :2] = torch.tensor([vocab - 1, 5])
    logits = torch.randn(capacity, vocab, generator=g)
    if ties:
        logits = logits.round()  # (about 18 lanes at 3.0, then 180 at 2.0)
    payloads, fused = [], []
    for one_call in (True, False):
        outputs.completion_logprobs.fill_(-7)
        step = StepReduction(model, None, outputs, "torch", torch.device("cpu"), rows=capacity)
        if step.call is None:
            pytest.skip("no compiled reduction or native gate on this machine")
        if not one_call:
            step.call, step.native = None, None  # the tensor-op gate and write, then the driver
        fused.append(record_calls(step.native) if step.native is not None else [])
        step(frame, logits[:4].to(torch.bfloat16), slots, epochs, positions)
        payloads.append(outputs.completion_logprobs.clone())
    assert fused[0] == [not ties]  # (ties: the C call left rows, the step finished them)
    assert torch.equal(payloads[0], payloads[1])
    gated = payloads[0][frame, [4, 1, 0], 0]
    assert (gated[:, 0] == torch.tensor([3, 20, 54])).all()  # the chosen ids, written
    assert (payloads[0][frame, 3] == -7).all() and (payloads[0][1 - frame] == -7).all()


@pytest.mark.parametrize("one_call", [True, False])
def test_a_token_outside_the_vocabulary_is_not_reduced(one_call: bool) -> None:
    """A record whose token is not a vocabulary id (a sampler fault: its empty pick) fails the
    gate: the step neither reads that lane nor writes the slot's payload, and the other rows
    are reduced. The host then fails that request (a missing entry), not the whole step."""
    vocab, capacity, tokens, frame = 423, 4, 2, 0
    model = SimpleNamespace(local_width=vocab, dtype=torch.float32, vocab_start=0,
                            local_valid=vocab, vocab_size=vocab)
    outputs = CompletionOutputs.allocate(capacity, tokens)
    records = outputs.completion_records[frame]
    chosen = [7, 2**31 - 1, -1, vocab]
    for slot, token in enumerate(chosen):
        records[slot, SLOT], records[slot, EPOCH], records[slot, KIND] = slot, 0, int(Kind.SAMPLE)
        records[slot, EMITTED], records[slot, FIRST_LOGIT_ROW] = 1, slot
        records[slot, HEADER] = token
    outputs.logprob_requested.fill_(1)
    outputs.completion_logprobs.fill_(-7)
    step = StepReduction(model, None, outputs, "torch", torch.device("cpu"), rows=capacity)
    if not one_call:
        step.call, step.native = None, None
    logits = torch.randn(capacity, vocab, generator=torch.Generator().manual_seed(3))
    step(frame, logits, list(range(capacity)), [0] * capacity, [0] * capacity)
    payload = outputs.completion_logprobs[frame]
    assert int(payload[0, 0, 0]) == 7
    assert (payload[1:] == -7).all()
    assert step.requested.tolist() == [1, 0, 0, 0]


def record_calls(native: NativeStepGate) -> list[bool]:
    """What each call of native.step returns, from now on."""
    calls: list[bool] = []
    step = native.step

    def recorded(*args):
        calls.append(step(*args))
        return calls[-1]

    native.step = recorded
    return calls
