"""The capacity report against real ranks (TP1, in process), and the CLI.

ranks/capacity/sizing.py computes every buffer from the configuration alone. Here real
RankSteps (and the coordinator's Engine) are built and the report is checked buffer by
buffer against the tensors at the paths it names, and in total against every tensor
reachable from the step: a buffer the code holds but the report does not list fails
``check_rank``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helios_logprobs.launch import capacity
from helios_logprobs.ranks.capacity.sizing import (
    frame_bytes,
    job_sizing,
    max_capacity,
    rank_sizing,
)
from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.runtime.engine.bootstrap import build_engine
from tests.capacity_checks import (
    REPO,
    build,
    check_host,
    check_kv_allocator,
    check_rank,
    sizing_of,
)
from tests.checkpoints import write_llama, write_qwen2
from tests.devices import interpreting_triton
from tests.oracles import build_checkpoint

# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return write_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """q/k norm weights: buffers the other two families do not have."""
    return build_checkpoint(tmp_path_factory.mktemp("qwen3") / "model", "qwen3")


CASES = {
    "k20": dict(),
    "prompt-logprobs": dict(prompt_logprobs=True, chunk_size=600),
    "k5-t3": dict(max_logprobs=5, completion_token_capacity=3),
    "logprobs-off": dict(logprobs=False),
    "speculative": dict(speculative_tokens=2, completion_token_capacity=4,
                        reduction_backend="torch"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("checkpoint", ["llama", "qwen2", "qwen3"])
def test_report_equals_the_rank_buffer_by_buffer(case, checkpoint, request):
    model_dir = request.getfixturevalue(checkpoint)
    config, step = build(model_dir, **CASES[case])
    sizing = sizing_of(step)
    check_rank(step, sizing)
    check_host(build_engine(config, step), step, sizing)
    frames = frame_bytes(step.config)
    assert frames.completion == step.outputs.nbytes
    ladder = step.scorer.ladder if step.scorer else ()
    assert frames.scored == sum(f.prompt_logprobs.nbytes + f.prompt_target_tokens.nbytes
                                for f in ladder)
    assert frames.host == sizing.host_bytes
    check_kv_allocator(step.model, sizing, 5, 7)


def test_report_tells_tied_from_untied_heads(llama, qwen2):
    _, tied = build(qwen2)
    _, untied = build(llama)
    kinds_tied = sizing_of(tied).weight_kind_bytes()
    kinds_untied = sizing_of(untied).weight_kind_bytes()
    assert kinds_tied["lm_head"] == 0 and tied.model.weights.lm_head is tied.model.weights.embed
    assert kinds_untied["lm_head"] == kinds_untied["embeddings"] > 0


@pytest.mark.triton_cpu
def test_triton_workspaces_are_listed(llama, monkeypatch):
    """The Triton reduction's prepared workspaces (interpreter geometry on CPU tensors)."""
    from helios_logprobs.kernels.triton import prepared, sharded
    from helios_logprobs.ranks.capacity import buffers

    # A serving process builds one step; here other tests may have cached larger launches
    # for the same width, which prepared_sharded would reuse.
    monkeypatch.setattr(sharded, "_PREPARED", {})

    assert buffers.TRITON_BLOCK_CAP == prepared.DEFAULT_BLOCK_SIZE
    assert buffers.TRITON_INTERPRETED_BLOCK_CAP == prepared.RANK_MAX_BLOCK
    assert interpreting_triton()
    _, step = build(llama, reduction_backend="triton")
    check_rank(step, sizing_of(step, interpreted=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or interpreting_triton(),
                    reason="needs a CUDA GPU with compiled Triton kernels")
def test_cuda_rank_bf16_triton_and_pinned_host_frames(qwen2, monkeypatch):
    """What a CUDA rank holds: BF16 weights, the GPU's Triton tile geometry, pinned host
    frames (scripts/device-check.sh runs this where a GPU is present)."""
    from helios_logprobs.kernels.triton import sharded

    monkeypatch.setattr(sharded, "_PREPARED", {})
    config, step = build(qwen2, device="cuda", reduction_backend="triton",
                         prompt_logprobs=True)
    assert step.model.dtype == torch.bfloat16
    sizing = sizing_of(step, interpreted=False)
    check_rank(step, sizing)
    engine = build_engine(config, step)
    assert engine.executor.host_records.is_pinned()
    check_host(engine, step, sizing)
    # CUDA's own buffers: the inputs' pinned twin (host) and the copy staging frame (device)
    assert step.buffers.host.is_pinned()
    assert sizing.pinned_bytes == step.buffers.host.untyped_storage().nbytes()
    assert sizing.staging_bytes == engine.executor.staging.untyped_storage().nbytes() > 0
    assert engine.executor.staging.is_cuda


def test_a_cuda_plan_lists_the_pinned_twin_and_the_staging_frame(llama):
    """CUDA's buffers from the configuration alone: the pinned upload twins of the step
    inputs and the sampler's plan pools (host memory: not in the device bytes), the copy
    staging frame on rank 0 (device memory: in the device bytes, not in the host bytes); the
    CPU plan has neither."""
    _, step = build(llama)
    config = step.model.config
    cpu = rank_sizing(config, step.config, 2, 0, "fp32")
    cuda = rank_sizing(config, step.config, 2, 0, "fp32", cuda=True)
    other = rank_sizing(config, step.config, 2, 1, "fp32", cuda=True)
    uploaded = [step.buffers.values, *(p.values for p in step.sampler.buffers.pools)]
    assert cpu.pinned_bytes == cpu.staging_bytes == 0
    tp1 = rank_sizing(config, step.config, 1, 0, "fp32", cuda=True)  # (the built step's TP)
    assert tp1.pinned_bytes == sum(t.nbytes for t in uploaded)
    assert cuda.pinned_bytes > 0 and other.pinned_bytes > 0
    payload = step.outputs.completion_logprobs
    assert cuda.staging_bytes == payload[0].numel() * 4 and other.staging_bytes == 0
    assert cuda.fixed_bytes == cpu.fixed_bytes and cuda.host_bytes == cpu.host_bytes
    assert cuda.device_bytes == cpu.device_bytes + cuda.staging_bytes
    memory = {b.path: b.memory for b in (*cuda.buffers, *cuda.host) if b.memory}
    pools = {f"sampler.buffers.{dtype}.host" for dtype in ("int64", "float32", "float64", "bool")}
    assert memory == {"buffers.host": "pinned", **dict.fromkeys(pools, "pinned"),
                      "executor.staging": "device"}


def test_budget_kv_capacity_and_largest_capacity(llama):
    config = ModelConfig.from_model_dir(llama)
    _, step = build(llama)
    sizing = sizing_of(step)
    per_token = sizing.kv_bytes_per_token
    fixed = sizing.weight_bytes + sizing.fixed_bytes
    usable = fixed + 10 * 64 * per_token + per_token - 1
    job = job_sizing(config, step.config, 1, "fp32", usable)
    assert job.kv_tokens == 10 * 64 and job.kv_sequences == 10 and job.shortfall == 0
    assert job.configured_fits  # capacity 3
    largest = max_capacity(config, step.config, 1, "fp32", usable)
    for cap, fits in ((largest, True), (largest + 1, False)):
        other = rank_sizing(config, replace(step.config, capacity=cap), 1, 0, "fp32")
        assert (other.device_bytes <= usable) == fits
    short = job_sizing(config, step.config, 1, "fp32", fixed - 1000)
    assert short.shortfall == 1000 and short.kv_tokens == 0


# ------------------------------------------------------------------------------------------
# The CLI
# ------------------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = capacity.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_sizes():
    parse = capacity.parse_bytes
    assert parse("80GiB") == 80 * 2**30
    assert parse("24 GB") == 24 * 10**9
    assert parse("1.5KiB") == 1536
    assert parse("123") == 123
    assert parse("2e9") == 2 * 10**9
    for bad in ("", "GiB", "-1GiB", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            parse(bad)


def test_table_and_json_for_a_checkpoint(llama, capsys):
    args = ("--model", str(llama), "--device", "cpu", "--device-memory", "64MiB",
            "--capacity", "3", "--max-model-len", "64")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    for text in ("weights", "completion_records", "sampler", "exchange 2 recv",
                 "KV cache", "tokens", "host records"):
        assert text in out, text
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    report = json.loads(out)
    _, step = build(llama)
    sizing = sizing_of(step)
    rank = report["ranks"][0]
    assert rank["weights"]["bytes"] == sizing.weight_bytes
    assert rank["fixed"]["bytes"] == sizing.fixed_bytes
    assert rank["kv"]["bytes_per_token"] == sizing.kv_bytes_per_token
    assert {b["path"] for b in rank["buffers"]} >= {b.path for b in sizing.buffers}
    usable = int(64 * 2**20 * 0.9)
    assert report["budget"]["usable"] == usable
    tokens = (usable - sizing.weight_bytes - sizing.fixed_bytes - sizing.host_bytes) \
        // sizing.kv_bytes_per_token
    assert report["kv"]["tokens"] == tokens and report["kv"]["sequences"] == tokens // 64
    assert "prompt_logprobs_cost" not in report


def test_prompt_logprobs_cost(llama, capsys):
    args = ("--model", str(llama), "--device", "cpu", "--device-memory", "64MiB",
            "--capacity", "3", "--max-model-len", "64", "--chunk-size", "600")
    code, out, _ = run_cli(capsys, *args, "--prompt-logprobs", "--json")
    assert code == 0
    report = json.loads(out)
    cost = report["prompt_logprobs_cost"]
    _, with_scoring = build(llama, prompt_logprobs=True, chunk_size=600)
    _, without = build(llama, chunk_size=600)
    added = sizing_of(with_scoring).fixed_bytes - sizing_of(without).fixed_bytes
    assert added > 0 and cost["fixed_bytes"] == added
    assert added == sizing_of(with_scoring).section_bytes("scoring")
    assert cost["kv_tokens_lost"] == (report["without_prompt_logprobs"]["kv"]["tokens"]
                                      - report["kv"]["tokens"])
    assert cost["kv_percent_lost"] == pytest.approx(
        100 * cost["kv_tokens_lost"] / report["without_prompt_logprobs"]["kv"]["tokens"])
    code, out, _ = run_cli(capsys, *args, "--prompt-logprobs")
    assert "--prompt-logprobs costs" in out and "C=512" in out


def test_too_small_a_budget_is_an_error_that_says_by_how_much(llama, capsys):
    _, step = build(llama)
    sizing = sizing_of(step)
    need = sizing.weight_bytes + sizing.fixed_bytes + sizing.host_bytes
    code, _, err = run_cli(capsys, "--model", str(llama), "--device", "cpu",
                           "--capacity", "3", "--max-model-len", "64",
                           "--device-memory", str(need - 100), "--memory-utilization", "1")
    assert code == 2
    assert "short by 100 B" in err
    code, out, _ = run_cli(capsys, "--model", str(llama), "--device", "cpu", "--capacity",
                           "3", "--max-model-len", "64", "--device-memory", str(need - 100),
                           "--memory-utilization", "1", "--json")
    assert code == 2 and json.loads(out)["shortfall"] == 100


def test_argument_errors(llama, capsys):
    base = ("--model", str(llama), "--device", "cpu")
    code, _, err = run_cli(capsys, *base)
    assert code == 2 and "--device-memory" in err
    code, _, err = run_cli(capsys, *base, "--device-memory", "1GiB", "--tp", "3")
    assert code == 2 and "not divisible" in err
    code, _, err = run_cli(capsys, *base, "--device-memory", "1GiB", "--memory-utilization",
                           "1.5")
    assert code == 2
    code, _, err = run_cli(capsys, *base, "--device-memory", "1GiB", "--prompt-logprobs",
                           "--no-logprobs")
    assert code == 2 and "prompt" in err


def test_speculative_rows(llama, capsys):
    """N speculative proposals: the sampler and the reduction hold capacity x (1 + N) rows."""
    code, out, _ = run_cli(capsys, "--model", str(llama), "--device", "cpu", "--device-memory",
                           "1GiB", "--capacity", "3", "--speculative-tokens", "2",
                           "--completion-token-capacity", "4", "--json")
    assert code == 0
    buffers = {b["path"]: b for b in json.loads(out)["ranks"][0]["buffers"]}
    assert buffers["sampler.scratch"]["shape"] == [9, 300]
    assert buffers["reduction.logits"]["shape"] == [9, 300]
    assert buffers["outputs.completion_records"]["shape"] == [2, 3, 20]
    code, _, err = run_cli(capsys, "--model", str(llama), "--device", "cpu", "--device-memory",
                           "1GiB", "--speculative-tokens", "8")
    assert code == 2 and "speculative_tokens" in err


def test_tp_ranks_with_padding(qwen2, capsys):
    """Vocabulary 301 at TP2: rank 1 holds one padding lane; every rank listed."""
    code, out, _ = run_cli(capsys, "--model", str(qwen2), "--device", "cpu", "--tp", "2",
                           "--device-memory", "1GiB", "--json")
    assert code == 0
    ranks = json.loads(out)["ranks"]
    assert [(r["vocab_start"], r["local_valid"], r["padding"]) for r in ranks] == [
        (0, 151, 0), (151, 150, 1)]
    assert "host" in ranks[0] and "host" not in ranks[1]


def test_model_tiny_is_the_embedded_one(llama, capsys, monkeypatch):

    calls = []
    import helios_logprobs.launch.tiny_model as tiny_model

    monkeypatch.setattr(tiny_model, "ensure_tiny_model",
                        lambda: calls.append(1) or llama)
    code, out, _ = run_cli(capsys, "--model", "tiny", "--device", "cpu", "--device-memory",
                           "1GiB", "--json")
    assert code == 0 and calls == [1]
    assert json.loads(out)["model"]["dir"] == str(llama)


def test_default_model_is_smollm2_in_float32_on_cpu(capsys):
    from helios_logprobs.launch.model_source import default_gguf

    code, out, _ = run_cli(capsys, "--device", "cpu", "--device-memory", "1GiB", "--json")
    assert code == 0
    report = json.loads(out)
    linked = Path(report["model"]["dir"]) / "model.gguf"
    assert linked.resolve() == default_gguf().resolve()
    assert report["settings"]["dtype"] == "float32"


def test_module_entry_point_and_console_script():
    result = subprocess.run([sys.executable, "-m", "helios_logprobs.launch.capacity", "--help"],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert "--device-memory" in result.stdout and "--memory-utilization" in result.stdout
    text = (REPO / "pyproject.toml").read_text()
    assert 'helios-capacity = "helios_logprobs.launch.capacity:main"' in text
