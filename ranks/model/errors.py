"""The model layer's load-time error for checkpoints it cannot run."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this runtime does not implement."""
