"""In-place weight updates from a checkpoint folder, on every rank of the group at once.

The coordinator first checks the new folder's safetensors headers against the served one's
(``check_same_tensors``: the same tensor names with the same shapes; dtypes may differ, the
values are cast to the serving dtype as at start-up). Then every rank gets ``UpdateWeights``
(the coordinator's own step thread runs it too) and ``apply_update``:

1. stage: read only this rank's slices of the new folder into host memory (the same reader
   and slicing as start-up, so a tensor whose shape differs is refused there too);
2. agree: every rank's outcome is gathered over the group, so either all ranks commit or none;
3. commit: copy the staged values into the serving tensors in place (the tensors keep their
   storage: captured graphs and views stay valid).

A failure at 1 or 2 on any rank leaves every rank's serving weights untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from helios_logprobs.collectives.codec import message
from helios_logprobs.collectives.groups import all_gather_object, group_rank
from helios_logprobs.ranks.model.errors import WeightLoadError
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


def tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape from a folder's safetensors headers (no data read)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise WeightUpdateError(f"{folder} is not a folder")
    if (folder / GGUF_FILE).is_file():
        raise WeightUpdateError(f"{folder} holds a GGUF file: weight updates read safetensors")
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
        raise WeightUpdateError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")
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
    """This rank's slices of ``model_path`` (or of ``reader``'s tensors), in host memory, in
    the serving dtype."""
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
