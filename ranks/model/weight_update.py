"""In-place weight updates from a checkpoint, on every rank of the group at once.

A checkpoint is a safetensors folder (Hugging Face's names), a GGUF file, or a folder that
links one (what a server started from a GGUF file serves: launch/gguf_folder.py); either
kind may update a server started from either, since the GGUF reader (ranks/model/gguf.py)
renames its tensors to Hugging Face's names, dequantizes them and undoes llama.cpp's q/k
permutation. The coordinator first checks the new checkpoint's headers against the served
one's (``check_same_tensors``: the same tensor names with the same shapes; dtypes and
quantization may differ, the values are cast to the serving dtype as at start-up). Then every
rank gets ``UpdateWeights`` (the coordinator's own step thread runs it too) and
``apply_update``:

1. stage: read only this rank's slices of the new checkpoint into host memory (the same reader
   and slicing as start-up, so a tensor whose shape differs is refused there too);
2. agree: every rank's outcome is gathered over the group, so either all ranks commit or none;
3. commit: copy the staged values into the serving tensors in place (the tensors keep their
   storage: captured graphs and views stay valid).

A failure at 1 or 2 on any rank leaves every rank's serving weights untouched.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from helios_logprobs.collectives.codec import message
from helios_logprobs.collectives.groups import all_gather_object, group_rank
from helios_logprobs.ranks.model.errors import ModelConfigError, WeightLoadError
from helios_logprobs.ranks.model.gguf import GGUF_FILE
from helios_logprobs.ranks.model.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    LayerWeights,
    ShardWeights,
    load_shard_weights,
)


class WeightUpdateError(ValueError):
    """A refused update; ``tensor`` names the offending tensor when there is one."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


@message("ranks.update_weights")
@dataclass(frozen=True)
class UpdateWeights:
    """Load ``model_path`` (checked by the coordinator) into every rank's shard."""

    model_path: str
    number: int
    """The update's sequence number on the coordinator (logs)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"UpdateWeights: bad model_path {self.model_path!r}")
        if type(self.number) is not int or self.number < 1:
            raise ValueError(f"UpdateWeights: bad number {self.number!r}")


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file an update path names: a ``.gguf`` file, or a folder that links one
    (a prepared folder, launch/gguf_folder.py); None for anything else."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / GGUF_FILE).is_file():
        return path / GGUF_FILE
    return None


def _gguf_reader(path: Path):
    """The file's ``gguf.GGUFReader`` (memory-mapped), kept per file version: opening one
    parses every metadata field, the vocabulary included (seconds for a real model), and an
    update compares the served file (and may read it back) every time."""
    stat = path.stat()
    return _gguf_reader_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _gguf_reader_of(path: str, size: int, mtime_ns: int):
    from helios_logprobs.ranks.model.gguf import open_gguf

    try:
        return open_gguf(path)
    except ModelConfigError as exc:
        raise WeightUpdateError(f"unreadable GGUF file {path}: {exc}") from exc


def _gguf_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a GGUF file's tensors (the reader's renaming; tensors
    it does not read are left out)."""
    from helios_logprobs.ranks.model.gguf import hf_name

    shapes = {}
    for tensor in _gguf_reader(path).tensors:
        name = hf_name(tensor.name)
        if name is not None:
            shapes[name] = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return shapes


def tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape (Hugging Face's names) from a safetensors folder's
    headers or a GGUF file's tensor infos (no data read)."""
    folder = Path(model_dir)
    gguf = gguf_file(folder)
    if gguf is not None:
        return _gguf_shapes(gguf)
    if not folder.is_dir():
        raise WeightUpdateError(f"{folder} is not a folder or a .gguf file")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                               .values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightUpdateError(f"unreadable {index}: {exc}") from exc
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise WeightUpdateError(f"no {SINGLE_FILE}, {INDEX_FILE} or {GGUF_FILE} in {folder}")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (OSError, ValueError, RuntimeError) as exc:
            raise WeightUpdateError(f"unreadable checkpoint file {folder / name}: {exc}") from exc
    return shapes


def check_same_tensors(served: str | Path, new: str | Path) -> None:
    """WeightUpdateError naming the first tensor (in name order) that the new folder lacks,
    adds, or holds with another shape than the served folder."""
    old_shapes, new_shapes = tensor_shapes(served), tensor_shapes(new)
    for name in sorted(old_shapes.keys() | new_shapes.keys()):
        if name not in new_shapes:
            raise WeightUpdateError(f"tensor {name!r} is missing in {new} (the served "
                                    f"checkpoint has it, shape {list(old_shapes[name])})", name)
        if name not in old_shapes:
            raise WeightUpdateError(f"tensor {name!r} in {new} is not a tensor of the served "
                                    f"checkpoint", name)
        if new_shapes[name] != old_shapes[name]:
            raise WeightUpdateError(f"tensor {name!r} has shape {list(new_shapes[name])} in "
                                    f"{new}, the served one {list(old_shapes[name])}", name)


def _pairs(serving: ShardWeights, staged: ShardWeights):
    """(serving tensor, staged tensor) for every tensor of the shard."""
    yield serving.embed, staged.embed
    yield serving.final_norm, staged.final_norm
    yield serving.lm_head, staged.lm_head
    for old, new in zip(serving.layers, staged.layers, strict=True):
        for spec in fields(LayerWeights):
            yield getattr(old, spec.name), getattr(new, spec.name)


def stage(model, model_path: str | Path | None, reader=None) -> ShardWeights:
    """This rank's slices of ``model_path`` (a safetensors folder, a GGUF file or a folder
    linking one; or ``reader``'s tensors), in host memory, in the serving dtype."""
    if reader is None and model_path is not None and gguf_file(model_path) is not None:
        from helios_logprobs.ranks.model.gguf import GGUFCheckpointReader

        path = gguf_file(model_path)
        reader = GGUFCheckpointReader(path, reader=_gguf_reader(path))
    staged = load_shard_weights(model_path, model.config, model.layout, torch.device("cpu"),
                                model.dtype, reader=reader)
    for old, new in _pairs(model.weights, staged):
        if (old is None) != (new is None) or (old is not None and old.shape != new.shape):
            raise WeightLoadError("the new shard does not match the serving shard's layout")
    return staged


def commit(model, staged: ShardWeights) -> None:
    """Copy the staged values into the serving tensors, in place."""
    with torch.no_grad():
        for old, new in _pairs(model.weights, staged):
            if old is not None:
                old.copy_(new)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def agree(model, error: str | None) -> str | None:
    """Every rank's outcome, gathered over ``model.group``: None when no rank failed, else
    the first failing rank's error (every rank of the group calls it)."""
    errors = all_gather_object(error, model.group)
    return next((e for e in errors if e is not None), None)


def apply_update(model, update: UpdateWeights) -> str | None:
    """Stage, agree, commit (see the module's docstring); every rank of ``model.group``
    calls it for the same update. None when every rank committed, else the first failing
    rank's error (then no rank changed anything)."""
    staged, error = None, None
    try:
        staged = stage(model, update.model_path)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"rank {group_rank(model.group)}: {exc}"
    failed = agree(model, error)
    if failed is None:
        commit(model, staged)
    return failed
