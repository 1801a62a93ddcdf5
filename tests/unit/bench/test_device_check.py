"""scripts/device-check.sh's plumbing on the CPU (the script itself runs on a GPU machine):
the shell script parses (and passes shellcheck where it is installed), refuses an unknown
argument with one ``helios: error`` line and exit status 2, and its Python steps
(scripts/device_check.py) run their --dry-run: the checkpoint is written with the asked
vocabulary, and decode serves eager and with the captured decode step replayed (a CPU
stand-in for the graphs), printing its table and writing its figure line."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess

import pytest

from tests.capacity_checks import REPO

SCRIPT = REPO / "scripts" / "device-check.sh"


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check",
                                                  REPO / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_parses_and_refuses_an_unknown_argument(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SCRIPT)], check=True, timeout=60)
    result = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True,
                            timeout=30, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "helios: error: unknown argument --fast (expected --dry-run)"]


def test_the_python_steps_dry_run(device_check, tmp_path, capsys):
    model = tmp_path / "qwen2"
    figures = tmp_path / "figure"
    assert device_check.main(["--figures", str(figures), "checkpoint", str(model),
                              "--vocab", "301"]) == 0
    assert json.loads((model / "config.json").read_text())["vocab_size"] == 301
    assert device_check.main(["--figures", str(figures), "decode", "--model", str(model),
                              "--modes", "eager,graphs", "--dry-run"]) == 0
    out = capsys.readouterr().out
    figure = figures.read_text().strip()
    assert f"figure: {figure}" in out
    assert figure.startswith("b4 K=20 tok/s (x none): eager ") and ", graphs " in figure
    assert "graphs: captured replays {'reduce': " in out
    table = [line.split() for line in out.splitlines()
             if line.split()[:1] in (["eager"], ["graphs"]) and len(line.split()) == 5]
    assert [(row[0], row[1]) for row in table] == [("eager", "1"), ("eager", "4"),
                                                   ("graphs", "1"), ("graphs", "4")]
    # tok/s > 0; the ratio only a number (a loaded machine can make the dry run's 6-token
    # decode time, less its prefill, tiny, and so one column huge and the ratio 0.000)
    assert all(float(value) > 0 for row in table for value in row[2:4])
    assert all(math.isfinite(float(row[4])) for row in table)


def test_the_reduction_bench_figure_reads_its_own_table_line():
    import time

    import torch

    from bench.reduction import figure, measure

    line = measure("torch", 1, torch.device("cpu"), 2, 100, torch.Generator().manual_seed(0),
                   time.perf_counter)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert figure(line) == f"2 x 100: speedup {cells[4]} over the baseline"
    cuda_line = line + " 2900 | 800 | 3000 |"  # (the three bandwidth cells a GPU adds)
    assert figure(cuda_line).endswith(", 2900 GB/s (a device copy: 3000 GB/s)")


def test_the_plain_checkpoint_has_the_transformers_layout_and_serves(device_check, tmp_path):
    """Without transformers (the GPU image may lack it) the checkpoint step writes the same
    names, shapes and config fields with safetensors alone, and the model loads and runs."""
    import torch
    from safetensors import safe_open

    from helios_logprobs.ranks.model import ShardedCausalLM
    from helios_logprobs.ranks.model.config import ModelConfig
    from tests.checkpoints import write_qwen2

    plain = device_check.write_plain_qwen2(tmp_path / "plain", 301)
    reference = write_qwen2(tmp_path / "reference")

    def layout(path):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    assert layout(plain) == layout(reference)
    assert ModelConfig.from_model_dir(plain) == ModelConfig.from_model_dir(reference)
    model = ShardedCausalLM.load(plain)
    model.allocate_cache(1, 16)
    logits = model(torch.tensor([5, 6, 7]), torch.arange(3), torch.zeros(3, dtype=torch.int64),
                   torch.tensor([2]))
    assert logits.shape == (1, 301) and torch.isfinite(logits).all()
