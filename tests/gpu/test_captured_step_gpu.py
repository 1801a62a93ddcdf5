"""The step's reduce phase and the frame copy on a CUDA GPU (issue 36): the reduce phase of a
real served step (tensor gate over the static row buffers, the six prepared Triton launches,
the payload write) captured in a CUDA graph replays to the eager payload and allocates
nothing over 1,000 replays; FrameExecutor's copies (leased pool frames, released after
reading) allocate nothing over 1,000 copies and land the requesting slots' payload prefixes
bit-equal to the device frame; the copy runs on the copy stream after the producing event and
the first read of the host frame waits on the transfer event; the graph-pool bytes count a
captured graph's pool; serving compiles no Triton kernel after start-up (counted at Triton's
compile hook, not the interpreter).

Skipped without CUDA (scripts/device-check.sh runs it on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import gpu_marks

pytestmark = gpu_marks()

from helios_logprobs.ranks.contract.completion import CompletionOutputs  # noqa: E402
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank  # noqa: E402
from helios_logprobs.runtime.engine.client import SamplingParams  # noqa: E402
from helios_logprobs.runtime.engine.config import RuntimeConfig  # noqa: E402
from helios_logprobs.runtime.engine.executor import FrameExecutor  # noqa: E402
from tests.gpu.checkpoint import write_qwen2  # noqa: E402

SENTINEL = -7
JOBS = [([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, logprobs=20,
                                      ignore_eos=True)),
        ([9, 8, 7], SamplingParams(max_tokens=6, temperature=0.0,
                                   logprob_token_ids=(3, 150, 7), ignore_eos=True)),
        ([1, 2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_qwen2(tmp_path_factory.mktemp("qwen2"))
    config = RuntimeConfig(model_dir=model_dir, device="cuda", dtype="float32", capacity=4,
                           max_model_len=64, reduction_backend="triton")
    return build_engine(config, load_rank(config, None))


class TritonCompiles:
    """Counts Triton compilations at its JIT cache hook (a miss compiles)."""

    def __init__(self) -> None:
        import triton

        self.count = 0
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            self.owner, self.name = knobs.runtime, "jit_cache_hook"
        else:
            from triton.runtime.jit import JITFunction

            self.owner, self.name = JITFunction, "cache_hook"
        self.previous = getattr(self.owner, self.name)

    def __enter__(self) -> TritonCompiles:
        def hook(*args, **kwargs):
            self.count += 1
            return False

        setattr(self.owner, self.name, hook)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.previous)


def last_inputs(engine):
    seen = []
    prepare = engine.step.prepare

    def keeping(plan):
        inputs = prepare(plan)
        if inputs.rows and engine.step.upload.requesting_slots:
            seen.append(inputs)
        return inputs

    engine.step.prepare = keeping
    return seen


def test_serving_compiles_no_triton_kernel_after_start_up(engine):
    with TritonCompiles() as compiles:
        engine.run_offline(JOBS)
    assert compiles.count == 0


def test_captured_reduce_phase_replays_to_the_eager_payload_without_allocating(engine):
    step = engine.step
    seen = last_inputs(engine)
    # Three requests, stopped while all three decode: the last submission is a full batch.
    engine.run_offline([(p, SamplingParams(**{**vars(s), "max_tokens": 3})) for p, s in JOBS])
    inputs = seen[-1]
    reduction, payload = step.reduction, step.outputs.completion_logprobs[inputs.frame]
    rows = inputs.logit_index.numel()

    def reduce():
        reduction(inputs.frame, reduction.logits[:rows], inputs.row_slots, inputs.row_epochs,
                  inputs.row_positions, inputs.row_tensors)

    payload.fill_(SENTINEL)
    reduce()
    eager = payload.clone()
    assert (eager != SENTINEL).any()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reduce()  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduce()
    payload.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(payload, eager)
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(payload, eager)


def random_outputs(capacity: int = 8, tokens: int = 4) -> CompletionOutputs:
    outputs = CompletionOutputs.allocate(capacity, tokens, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    outputs.completion_logprobs.copy_(torch.randint(
        -99, 99, outputs.completion_logprobs.shape, generator=g, device="cuda",
        dtype=torch.int32))
    outputs.completion_records.copy_(torch.randint(
        0, 99, outputs.completion_records.shape, generator=g, device="cuda"))
    return outputs


@pytest.mark.parametrize("requesting", [[0, 1, 2, 5], [3], []])
def test_frame_copies_allocate_nothing_and_hold_the_requesting_prefixes(requesting):
    outputs = random_outputs()
    executor = FrameExecutor(outputs)
    width = 5
    words = 2 + 2 * width
    assert executor.host_records.is_pinned() and executor.host_payload.is_pinned()
    for submission in (0, 1, 2, 3):  # warm-up: each pool frame's views
        executor.copy(submission, requesting, width).release()
    before = torch.cuda.memory_allocated()
    for submission in range(1000):
        host = executor.copy(submission, requesting, width)
        if submission < 999:
            host.release()
    assert torch.cuda.memory_allocated() == before
    assert host.payload.flags["C_CONTIGUOUS"]
    source = outputs.completion_logprobs[host.frame].cpu().numpy()
    assert (host.records == outputs.completion_records[host.frame].cpu().numpy()).all()
    for slot in requesting:
        assert host.payload[slot].tobytes() == source[slot, :, :words].tobytes(), slot
    host.release()
    assert executor.pool.leased() == []
    copied = executor.counters.payload_copies
    assert copied == (1004 if requesting else 0)


def test_the_copy_waits_on_the_producing_event_and_decoding_on_the_transfer_event():
    """The step's stream is held by a sleep, then writes the frame (the producing work): the
    copy returns at once, its transfer event is still pending, and the first read of the host
    frame waits for it and sees the values written after the sleep."""
    outputs = random_outputs()
    executor = FrameExecutor(outputs)
    requesting, width = [1, 2, 6], 4
    words = 2 + 2 * width
    wanted = outputs.completion_logprobs.clone()
    wanted_records = outputs.completion_records.clone()
    for submission in (0, 1):
        executor.copy(submission, requesting, width).release()  # (warm-up)
    outputs.completion_logprobs.fill_(-1)
    outputs.completion_records.fill_(-1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # (about 0.1 s of GPU cycles on the step's stream)
    outputs.completion_logprobs.copy_(wanted)
    outputs.completion_records.copy_(wanted_records)
    host = executor.copy(7, requesting, width)
    transfer = executor.transferred[host.lease.index]
    assert not transfer.query()  # nothing waited on the host: the copy stream is queued
    assert executor.stream != torch.cuda.current_stream()
    payload = host.payload  # waits on the transfer event
    assert transfer.query()
    frame = CompletionOutputs.frame_index(7)
    assert (host.records == wanted_records[frame].cpu().numpy()).all()
    source = wanted[frame].cpu().numpy()
    for slot in requesting:
        assert payload[slot].tobytes() == source[slot, :, :words].tobytes(), slot
    host.release()


def test_graph_pool_bytes_count_captured_graphs_only():
    """The memory report's graph-pool figure: the private pools' segments, 0 with no graph
    held, more once a graph is captured (and allocated/reserved are the allocator's)."""
    from helios_logprobs.ranks.step.device_memory import device_memory

    device = torch.device("cuda")
    torch.cuda.synchronize()
    before = device_memory(device)
    assert before["device_memory_allocated"] == torch.cuda.memory_allocated(device)
    assert before["device_memory_reserved"] == torch.cuda.memory_reserved(device)
    x = torch.ones(1 << 20, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
    graph.replay()
    torch.cuda.synchronize()
    captured = device_memory(device)["device_memory_graph_pool"]
    assert captured >= y.numel() * 4 and captured > before["device_memory_graph_pool"]
