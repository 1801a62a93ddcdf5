"""--model resolution: the Hugging Face cache as the hub lays it out (huggingface_hub itself is
the oracle of where a repo and revision live), GGUF files and folders, the default and tiny."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helios_logprobs.launch.model_source import ModelSourceError, default_gguf, resolve_model
from helios_logprobs.launch.tiny_model import ensure_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture()
def hub(tmp_path: Path) -> Path:
    """A hub cache holding the tiny model as org/tiny at main (COMMIT) and at tag v1 (OLDER)."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit in (COMMIT, OLDER):
        shutil.copytree(ensure_tiny_model(), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OLDER)
    return cache


def hub_oracle(cache: Path, repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))


@pytest.mark.parametrize("revision", [None, "main", "v1", OLDER])
def test_hub_cache_resolves_where_huggingface_hub_does(hub, monkeypatch, revision):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    source = resolve_model("org/tiny", revision)
    assert source.path == hub_oracle(hub, "org/tiny", revision)
    assert (source.kind, source.name) == ("hf-folder", "org/tiny")


def test_hf_home_is_read_when_hf_hub_cache_is_unset(hub, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    shutil.move(str(hub), str(home / "hub"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model("org/tiny", None).path == home / "hub" / "models--org--tiny" / (
        "snapshots") / COMMIT


def test_a_miss_says_where_it_looked_and_how_to_download(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(ModelSourceError) as missing:
        resolve_model("Qwen/Qwen2-0.5B", None)
    assert str(hub) in str(missing.value)
    assert "hf download Qwen/Qwen2-0.5B" in str(missing.value)
    with pytest.raises(ModelSourceError, match="hf download org/tiny --revision nope"):
        resolve_model("org/tiny", "nope")


def test_local_folders_and_tiny(tmp_path):
    tiny = resolve_model("tiny", None)
    assert tiny.path == Path(ensure_tiny_model()) and tiny.kind == "hf-folder"
    assert resolve_model(str(tiny.path), None).name == tiny.path.name
    with pytest.raises(ModelSourceError, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path), None)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="must be a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"), None)


def test_the_default_is_smollm2_and_a_gguf_folder_resolves_alike(tmp_path):
    default = resolve_model(None, None)
    assert default.kind == "gguf" and default.name == "SmolLM2-135M-Instruct"
    assert (default.path / "model.gguf").resolve() == default_gguf().resolve()
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "model-q4.gguf").symlink_to(default_gguf())
    again = resolve_model(str(holder), None)
    assert again.kind == "gguf" and (again.path / "model.gguf").resolve() == default_gguf()


def test_a_cached_gguf_repo_resolves_to_its_file(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--smol-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "smol.Q4_1.gguf").symlink_to(default_gguf())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("org/smol-GGUF", None)
    assert (source.kind, source.name) == ("gguf", "org/smol-GGUF")
    assert (source.path / "model.gguf").resolve() == default_gguf().resolve()
