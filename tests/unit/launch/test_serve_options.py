"""The server's command line (launch/serve_options.py): vLLM's names beside the project's,
vLLM's argument groups in --help with every default, and no torch before a server starts."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helios_logprobs.launch.serve_options import GROUPS, parse_serve_args, serve_parser
from helios_logprobs.runtime.engine.scheduler import unset_seed
from helios_logprobs.runtime.http.protocol.defaults import FROM_MODEL
from helios_logprobs.runtime.http.protocol.limits import DEFAULT_MAX_REQUEST_BYTES

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("vllm", "ours", "dest"), [
    (["--max-num-seqs", "3"], ["--capacity", "3"], "capacity"),
    (["--max-num-batched-tokens", "48"], ["--max-batched-tokens", "48"], "max_batched_tokens"),
    (["--tensor-parallel-size", "2"], ["--tp", "2"], "tensor_parallel_size"),
    (["-tp", "2"], ["--tp", "2"], "tensor_parallel_size"),
    (["some/model"], ["--model", "some/model"], "model"),
])
def test_vllm_names_and_the_projects_own_are_the_same_setting(vllm, ours, dest):
    a, b = parse_serve_args(vllm), parse_serve_args(ours)
    assert getattr(a, dest) == getattr(b, dest)
    assert str(getattr(a, dest)) in {"3", "48", "2", "some/model"}


def test_several_served_names_and_list_valued_cors_flags():
    args = parse_serve_args(["--served-model-name", "a", "b", "--allowed-origins",
                             '["http://x.example"]', "--api-key", "k1", "k2"])
    assert args.served_model_name == ["a", "b"]
    assert args.allowed_origins == ["http://x.example"] and args.allowed_methods == ["*"]
    assert args.api_key == ["k1", "k2"]


def test_the_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.delenv("HELIOS_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_serve_args([]).api_key is None
    monkeypatch.setenv("HELIOS_API_KEY", "helios-key")
    assert parse_serve_args([]).api_key == ["helios-key"]
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert parse_serve_args([]).api_key == ["vllm-key"]
    assert parse_serve_args(["--api-key", "flag-key"]).api_key == ["flag-key"]


@pytest.mark.parametrize(("argv", "message"), [
    (["m1", "--model", "m2"], "the model is given twice"),
    (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--allowed-origins", "*"], "not JSON"),
    (["--tp", "0"], "must be >= 1"),
])
def test_a_refused_command_line_is_one_line_and_status_2(argv, message, capfd):
    with pytest.raises(SystemExit) as leaving:
        parse_serve_args(argv)
    assert leaving.value.code == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("helios: error: ") and message in err, err


def test_the_constants_match_the_modules_that_need_torch():
    parser = serve_parser()
    defaults = {a.dest: a.default for a in parser._actions}
    assert defaults["generation_config"] == FROM_MODEL
    assert defaults["max_request_bytes"] == DEFAULT_MAX_REQUEST_BYTES


def help_sections(text: str) -> dict[str, str]:
    """argparse's help by section title (an unindented line ending with a colon)."""
    sections: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_help_groups_every_flag_as_vllm_does_and_shows_its_default():
    """Run as a user would, with -X importtime: torch is never imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m",
                           "helios_logprobs.launch.serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, COLUMNS="200"))
    assert done.returncode == 0, done.stderr
    assert not re.search(r"\|\s+torch$", done.stderr, re.MULTILINE)
    sections = help_sections(done.stdout)
    parser = serve_parser()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        flag = action.option_strings[0]
        title = next((t for t, flags in GROUPS.items() if set(flags) & set(action.option_strings)),
                     "Helios")
        assert title in sections, (title, list(sections))
        entry = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", sections[title],
                          re.MULTILINE | re.DOTALL)
        assert entry, (flag, title)
        assert "default" in entry.group(0), entry.group(0)


def test_the_server_seed_fixes_each_unseeded_draw():
    assert unset_seed(7, 1) == unset_seed(7, 1)
    assert len({unset_seed(7, n) for n in range(1, 50)}) == 49
    assert unset_seed(7, 1) != unset_seed(8, 1)
    assert all(0 <= unset_seed(s, n) < 2**63 for s in (0, 7) for n in (1, 2))
    assert unset_seed(None, 1) != unset_seed(None, 1)  # fresh draws (63 bits)


@pytest.mark.parametrize(("argv", "compiled", "captured"), [
    ([], False, True), (["--compile"], True, True),
    (["--compile", "--enforce-eager"], False, False), (["--enforce-eager"], False, False)])
def test_enforce_eager_turns_off_compilation_and_cuda_graphs(argv, compiled, captured):
    from helios_logprobs.launch.arguments import runtime_config

    config = runtime_config(parse_serve_args(argv), "cpu")
    step = config.step_config(64)
    assert (config.compile, step.compile) == (compiled, compiled)
    assert (config.cuda_graphs, step.cuda_graphs) == (captured, captured)
