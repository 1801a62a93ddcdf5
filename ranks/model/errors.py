"""The model layer's load-time errors for checkpoints it cannot run."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this runtime does not implement."""


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape, or the files are unreadable."""


class ModelConfigError(ValueError):
    """config.json lacks a field or holds a value no checkpoint of its kind can have."""
