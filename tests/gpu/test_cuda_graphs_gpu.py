"""The captured decode step on a CUDA GPU (ranks/step/cuda_graphs.py, issue 36): a served run
whose decode submissions replay the captured reduce phase answers exactly what the eager
engine answers, and with --compile (the compiled forward's decode buckets and the compiled
reduce region captured) the same tokens with logprobs within 1e-5 and no recompilation;
every variant is in one graph pool, whose bytes the memory report shows;
memory_allocated is flat across 1,000 replays; serving with graphs compiles no Triton kernel
after start-up (counted at Triton's compile hook); the frame copy of a served frame holds only
the requesting slots' chosen pair and first W pairs, and a frame without a requesting lane
copies no payload.

Skipped without CUDA (scripts/device-check.sh runs it on a GPU machine).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.devices import gpu_marks

pytestmark = gpu_marks()

from helios_logprobs.kernels.layout import FIRST_PAIR  # noqa: E402
from helios_logprobs.ranks.step.cuda_graphs import (  # noqa: E402
    DECODE,
    REDUCE,
    GraphKey,
    enable_decode_graphs,
)
from helios_logprobs.ranks.step.device_memory import device_memory  # noqa: E402
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank  # noqa: E402
from helios_logprobs.runtime.engine.client import SamplingParams  # noqa: E402
from helios_logprobs.runtime.engine.config import RuntimeConfig  # noqa: E402
from helios_logprobs.runtime.outputs import GeneratedToken  # noqa: E402
from tests.gpu.checkpoint import write_qwen2  # noqa: E402
from tests.gpu.test_captured_step_gpu import TritonCompiles  # noqa: E402
from tests.unit.ranks.test_cuda_graphs import close  # noqa: E402

SENTINEL = -7


def jobs() -> list[tuple[list[int], SamplingParams]]:
    def params(tokens: int, **extra) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)

    return [([5, 6, 7], params(12, logprobs=20)), ([8, 9], params(5, logprobs=3)),
            ([4, 5], params(9, logprob_token_ids=(100, 7, 250))), ([3, 1, 4], params(10)),
            ([2, 7, 1, 8], params(7, logprobs=20))]


def generated(results) -> list[list[GeneratedToken]]:
    return [[e for e in events if isinstance(e, GeneratedToken)] for events in results]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    model_dir = write_qwen2(tmp_path_factory.mktemp("qwen2"))
    return RuntimeConfig(model_dir=model_dir, device="cuda", dtype="float32", capacity=4,
                         max_model_len=64, reduction_backend="triton")


@pytest.fixture(scope="module")
def graphed(config):
    step = load_rank(config, None)
    graphs = enable_decode_graphs(step)
    assert graphs is not None
    return build_engine(config, step), graphs


def test_replay_answers_as_eager_and_compiles_nothing_while_serving(config, graphed):
    eager = generated(build_engine(config, load_rank(config, None)).run_offline(jobs()))
    engine, graphs = graphed
    engine.run_offline(jobs())  # (warm: the first serving run's eager paths)
    replays = graphs.counters.replays[REDUCE]
    with TritonCompiles() as compiles:
        served = generated(engine.run_offline(jobs()))
    assert compiles.count == 0
    assert served == eager
    assert graphs.counters.replays[REDUCE] > replays + 10


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_forward_and_reduce_replay_as_eager(config, backend):
    """--compile with each backend's ops in the reduce region (the Triton backend's
    triton_ops, the CUDA default; the torch backend's custom ops)."""
    eager_config = replace(config, reduction_backend=backend)
    eager = generated(build_engine(eager_config, load_rank(eager_config, None))
                      .run_offline(jobs()))
    compiled = replace(eager_config, compile=True)
    step = load_rank(compiled, None)
    graphs = enable_decode_graphs(step)
    assert graphs.forward_capture is not None and graphs.reduce_frames == (0,)
    served = generated(build_engine(compiled, step).run_offline(jobs()))
    close(served, eager)
    assert graphs.counters.replays[DECODE] > 10 and graphs.counters.replays[REDUCE] > 10
    stats = step.serve_stats()
    assert stats["compile_recompilations"] == 0 and stats["compile_graph_breaks"] == 0
    pools = {graph.pool() for graph in graphs.graphs.graphs.values()}
    assert pools == {graphs.graphs.pool}


def test_every_variant_is_in_one_pool_and_the_report_counts_it(graphed):
    engine, graphs = graphed
    pools = {graph.pool() for graph in graphs.graphs.graphs.values()}
    assert pools == {graphs.graphs.pool}
    memory = device_memory(engine.step.device)
    assert memory["device_memory_graph_pool"] > 0
    stats = engine.step.serve_stats()
    assert stats["device_memory_graph_pool"] == memory["device_memory_graph_pool"]
    assert stats["device_memory_reserved"] >= stats["device_memory_allocated"] > 0


def test_a_thousand_replays_allocate_nothing(graphed):
    engine, graphs = graphed
    payload = engine.step.outputs.completion_logprobs
    key = GraphKey(REDUCE, graphs.max_rows, 0)
    graphs.graphs.replay(key)
    torch.cuda.synchronize()
    first = payload.clone()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        graphs.graphs.replay(key)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.equal(payload, first)  # (the same static inputs: the same payload)


def test_served_frames_copy_only_the_requesting_prefixes(graphed):
    """Every copy of a served run (graphs on): the pool frame's words outside the requesting
    slots' [T, 2+2W] prefix keep the sentinel, inside they equal the device frame; a frame
    without a requesting lane leaves the whole payload storage alone."""
    engine, _ = graphed
    executor, outputs = engine.executor, engine.step.outputs
    copy, seen = executor.copy, []

    def checked(submission, requesting, width, entropy=False):
        executor.host_payload.fill_(SENTINEL)
        host = copy(submission, requesting, width, entropy)
        words = FIRST_PAIR + 2 * width
        device = outputs.completion_logprobs[host.frame].cpu().numpy()
        payload = host.payload  # (waits on the transfer event)
        storage = executor.host_payload[host.lease.index].view(-1).numpy()
        prefix = payload.size if requesting else 0
        assert (storage[prefix:] == SENTINEL).all()
        for slot in range(payload.shape[0]):
            if slot in requesting:
                assert payload[slot].tobytes() == device[slot, :, :words].tobytes(), slot
            elif requesting:
                assert (payload[slot] == SENTINEL).all(), slot
        seen.append(len(requesting))
        return host

    executor.copy = checked
    try:
        engine.run_offline(jobs())
    finally:
        executor.copy = copy
    assert any(seen) and 0 in seen
