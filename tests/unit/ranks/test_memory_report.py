"""The memory report (issue 36): the capacity report's ``memory`` section and /metrics'
device figures. The frame bytes are checked against the tensors a built step and its engine
hold; the device fields exist on CUDA only (a CUDA plan needs no GPU: --device-memory)."""

from __future__ import annotations

import json

import pytest
from prometheus_client.core import Metric

from helios_logprobs.launch import capacity
from helios_logprobs.runtime.engine.bootstrap import build_engine
from helios_logprobs.runtime.http.metrics import step_metrics
from tests.capacity_checks import build
from tests.checkpoints import write_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


def memory_of(capsys, *argv: str) -> dict:
    code = capacity.main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("extra", [(), ("--prompt-logprobs", "--chunk-size", "600")])
def test_frame_bytes_are_the_built_frames_and_the_cpu_has_no_device_fields(llama, capsys,
                                                                           extra):
    report = memory_of(capsys, "--model", str(llama), "--device", "cpu", "--device-memory",
                       "256MiB", "--capacity", "3", "--max-model-len", "64", *extra)
    memory = report["memory"]
    assert set(memory) == {"frames"}  # (no device allocator on the CPU)
    config, step = build(llama, capacity=3, max_model_len=64,
                         **({"prompt_logprobs": True, "chunk_size": 600} if extra else {}))
    engine = build_engine(config, step)
    assert not any(name.startswith("device_memory") for name in step.serve_stats())
    completion = step.outputs.nbytes
    scored = sum(f.prompt_logprobs.nbytes + f.prompt_target_tokens.nbytes
                 for f in (step.scorer.ladder if step.scorer else ()))
    host = engine.executor.pool.stats().nbytes + (
        engine.prompts.host.nbytes if engine.prompts is not None else 0)
    assert memory["frames"] == {"completion": completion, "scored": scored,
                                "device": completion + scored, "host": host}
    assert (scored > 0) == bool(extra)


def test_a_cuda_plan_reports_the_device_totals_and_a_graph_pool_of_zero(llama, capsys):
    report = memory_of(capsys, "--model", str(llama), "--device", "cuda", "--device-memory",
                       "1GiB", "--capacity", "3", "--max-model-len", "64", "--tp", "2")
    device = report["memory"]["device"]
    ranks = report["ranks"]
    assert device["allocated"] == max(r["device_bytes_at_configured_capacity"] for r in ranks)
    # (rank 0 also holds the executor's device staging frame: one frame's payload words)
    staging = ranks[0]["host"]["device_staging_bytes"]
    payload = next(b for b in ranks[0]["buffers"] if b["path"].endswith("completion_logprobs"))
    assert staging == payload["bytes"] // 2 > 0
    assert device["allocated"] == max(r["weights"]["bytes"] + r["fixed"]["bytes"]
                                      + r["kv"]["configured_bytes"]
                                      + r.get("host", {}).get("device_staging_bytes", 0)
                                      for r in ranks)
    pinned = [b for b in ranks[1]["buffers"] if b.get("memory") == "pinned"]
    assert {b["path"] for b in pinned} == {"buffers.host", *(
        f"sampler.buffers.{dtype}.host" for dtype in ("int64", "float32", "float64", "bool"))}
    assert device["reserved_limit"] == report["budget"]["usable"] == int(2**30 * 0.9)
    assert device["graph_pool"] == 0 and "0 until CUDA graphs are captured" in \
        device["graph_pool_note"]
    cpu = memory_of(capsys, "--model", str(llama), "--device", "cpu", "--device-memory",
                    "1GiB", "--capacity", "3", "--max-model-len", "64", "--tp", "2")
    assert report["memory"]["frames"] == cpu["memory"]["frames"]  # (int frames: any dtype)


def samples(metrics: list[Metric]) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("kind", "")): s.value for m in metrics for s in m.samples}


def test_metrics_show_the_graph_pool_beside_allocated_and_reserved_on_cuda_only():
    cuda = samples(list(step_metrics({"compile_graphs": 0, "device_memory_allocated": 5,
                                      "device_memory_reserved": 8,
                                      "device_memory_graph_pool": 0})))
    assert cuda[("helios:device_memory_bytes", "allocated")] == 5
    assert cuda[("helios:device_memory_bytes", "reserved")] == 8
    assert cuda[("helios:device_memory_bytes", "graph_pool")] == 0
    cpu = samples(list(step_metrics({"compile_graphs": 0})))
    assert not any(name == "helios:device_memory_bytes" for name, _ in cpu)
