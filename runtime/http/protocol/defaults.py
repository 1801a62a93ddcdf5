"""The model creator's sampling defaults: vLLM's ``--generation-config``.

vLLM (``--generation-config auto``, its default) reads ``generation_config.json`` from the
model directory and uses its ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` for every request that leaves the field unset, and its
``max_new_tokens`` as a cap on every request's ``max_tokens``. ``vllm`` keeps the neutral
defaults (temperature 1, no filters, no penalty); a directory reads that directory's file.
Values are checked once, at start-up, against the bounds requests are held to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from helios_logprobs.ranks.model.config import read_json_object

NEUTRAL = "vllm"
FROM_MODEL = "auto"
FILE_NAME = "generation_config.json"


class GenerationConfigError(ValueError):
    """generation_config.json holds a sampling default no request could carry."""


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the neutral default (vLLM's SamplingParams defaults)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = ""
    """Where the values came from (for errors and the start-up log)."""

    def __post_init__(self) -> None:
        checks = {
            "temperature": lambda v: 0 <= v <= 2,
            "top_p": lambda v: 0 < v <= 1,
            "min_p": lambda v: 0 <= v <= 1,
            "repetition_penalty": lambda v: v > 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and math.isfinite(value) and ok(value)):
                raise GenerationConfigError(f"{self.source}: {name} {value!r} is out of range")
        for name, low in (("top_k", -1), ("max_tokens", 1)):
            value = getattr(self, name)
            if value is not None and not (_is_integer(value) and value >= low):
                raise GenerationConfigError(
                    f"{self.source}: {'max_new_tokens' if name == 'max_tokens' else name} "
                    f"must be an integer >= {low}, got {value!r}")

    def overrides(self) -> dict[str, Any]:
        """The defaults this file sets, by request field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}


def load_sampling_defaults(generation_config: str, model_dir: str | Path) -> SamplingDefaults:
    """``generation_config``: ``auto`` (the model directory's file), ``vllm`` (none) or a
    directory holding generation_config.json. A missing file gives the neutral defaults, as in
    vLLM; a named directory without one is an error."""
    if generation_config == NEUTRAL:
        return SamplingDefaults(source="--generation-config vllm")
    directory = Path(model_dir if generation_config == FROM_MODEL else generation_config)
    path = directory / FILE_NAME
    if not path.is_file():
        if generation_config != FROM_MODEL:
            raise GenerationConfigError(f"--generation-config {generation_config}: no {FILE_NAME}")
        return SamplingDefaults(source=str(path))
    raw = read_json_object(path, GenerationConfigError)
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    values = {name: raw.get(name) for name in names}
    return SamplingDefaults(**values, max_tokens=raw.get("max_new_tokens"), source=str(path))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
