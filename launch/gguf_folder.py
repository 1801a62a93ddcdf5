"""Turn a GGUF file into a folder the rest of the runtime reads like a Hugging Face checkpoint.

Written once per file into ``<cache>/gguf/<key>/`` (``$HELIOS_CACHE`` or ~/.cache/helios): the
``config.json`` its metadata describes, ``tokenizer.json`` and ``tokenizer_config.json`` built
from its vocabulary (with the chat template), and ``model.gguf``, a link to the file itself:
the weights are always read from the GGUF file (ranks/model/gguf.py), never copied.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from helios_logprobs.ranks.model.errors import ModelConfigError
from helios_logprobs.ranks.model.gguf import GGUF_FILE, hf_config, open_gguf

FORMAT = "helios-gguf-2"
"""Bump when what a prepared folder holds changes, so old folders are rebuilt."""


def gguf_cache_root() -> Path:
    base = os.environ.get("HELIOS_CACHE") or Path.home() / ".cache" / "helios"
    return Path(base) / "gguf"


def folder_key(path: Path) -> str:
    """The file's identity: where it is, its size and modification time, the format."""
    stat = path.stat()
    text = f"{FORMAT}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_gguf_folder(path: str | Path, cache_root: Path | None = None) -> Path:
    """The prepared folder for a GGUF file, built on first use."""
    from helios_logprobs.launch.gguf_tokenizer import gguf_tokenizer

    path = Path(path).resolve()
    if not path.is_file():
        raise ModelConfigError(f"no GGUF file at {path}")
    root = cache_root or gguf_cache_root()
    folder = root / f"{path.stem}-{folder_key(path)}"
    if (folder / "config.json").is_file():
        return folder
    reader = open_gguf(path)
    config = hf_config(reader)
    tokenizer, tokenizer_config = gguf_tokenizer(reader)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (staging / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8")
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / GGUF_FILE).symlink_to(path)
        try:
            staging.rename(folder)
        except OSError:  # another process prepared it first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
