"""Refusals at start-up: one `helios: error: ...` line (rank 0's alone), exit status 2, no
traceback. A checkpoint directory (naming the file, field or tensor), shapes that do not shard
over the ranks, an unknown flag, a taken port (before the weights load), a TP size the job
does not have."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.devices import rank_env
from tests.server.helpers import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("edit", "message"), [
    ("generation", "generation_config.json: top_p 0 is out of range"),
    ("rope", "unsupported rope scaling 'dynamic' in rope_scaling"),
    ("weights", "missing tensor 'model.norm.weight'"),
    ("field", "config.json: missing field 'hidden_size'"),
    ("value", "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_a_checkpoint_refused_at_start_up_says_why_in_one_line(tmp_path, model_dirs, edit,
                                                                message):
    """A bad generation_config.json (before any weight is read), an unsupported, missing or
    impossible config.json field, or a missing tensor: one `helios: error: ...` line naming
    it, exit status 2, no traceback."""
    model_dir = tmp_path / "model"
    shutil.copytree(model_dirs["byte_level"], model_dir)
    if edit == "generation":
        (model_dir / "generation_config.json").write_text('{"top_p": 0}')
    elif edit in ("rope", "field", "value"):
        config = json.loads((model_dir / "config.json").read_text())
        if edit == "rope":
            config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
        elif edit == "field":
            del config["hidden_size"]
        else:
            config["num_key_value_heads"] = 3
        (model_dir / "config.json").write_text(json.dumps(config))
    else:
        tensors = load_file(str(model_dir / "model.safetensors"))
        del tensors["model.norm.weight"]
        save_file(tensors, str(model_dir / "model.safetensors"))
    done = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.serve", "--model", str(model_dir),
         "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "helios: error: " in done.stderr and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def refusal_line(done: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2 and one `helios: error: ...` line (on stderr) naming ``message``."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("helios: error: "), done.stderr
    assert message in lines[0], lines[0]


def nine_head_model(path: Path, tokenizer_from: Path) -> Path:
    """SmolLM2's head layout (9 query heads, 3 KV heads) on a tiny random Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=72, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def test_shapes_that_do_not_shard_are_refused_in_one_line_at_tp2(tmp_path, model_dirs):
    """9 heads over 2 ranks: rank 0's line alone, status 2, no traceback per rank and no
    torchrun summary (helios-serve runs torchrun)."""
    model_dir = nine_head_model(tmp_path / "nine", model_dirs["byte_level"])
    done = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.wrapper", str(model_dir),
         "--tensor-parallel-size", "2", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env=rank_env(2, dict(os.environ, OMP_NUM_THREADS="1")))
    refusal_line(done, "num_attention_heads 9 is not divisible by tensor-parallel size 2")
    assert done.stdout == ""


@pytest.mark.parametrize("command", [
    ["-m", "helios_logprobs.launch.serve"],
    ["-m", "helios_logprobs.launch.wrapper", "-tp", "2"],
])
def test_an_unknown_flag_is_refused_in_one_line(command):
    start = time.monotonic()
    done = subprocess.run([sys.executable, *command, "--port", "0", "--no-such-flag"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    done.stderr = "".join(f"{line}\n" for line in done.stderr.splitlines()
                          if not line.startswith("import time:"))
    refusal_line(done, "unrecognized arguments: --no-such-flag")
    assert not any(line.endswith("| torch") for line in imports)  # refused before torch
    assert time.monotonic() - start < 20


def test_a_taken_port_is_refused_before_the_weights_load(model_dirs):
    """The port is bound first: refused in one line before torch is even imported."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "helios_logprobs.launch.serve", "--model",
             str(model_dirs["byte_level"]), "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
        elapsed = time.monotonic() - start
    imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    done.stderr = "".join(f"{line}\n" for line in done.stderr.splitlines()
                          if not line.startswith("import time:"))
    refusal_line(done, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert imports and not any(line.endswith("| torch") for line in imports)
    assert elapsed < 20


def test_a_tensor_parallel_size_the_job_does_not_have_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.serve", "-tp", "2", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    refusal_line(done, "--tensor-parallel-size 2 needs 2 ranks, this job has 1")
