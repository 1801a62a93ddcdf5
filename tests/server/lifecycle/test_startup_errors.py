"""A checkpoint directory refused at start-up: one line that names the file, field or tensor,
exit status 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

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
