"""Suite-wide set-up. Where tests run (CPU and gloo, even on a GPU host) is described in
tests/devices.py."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU through the interpreter unless a GPU is present. This must be set
# before triton is first imported in the worker process (see tests/devices.py for a GPU host).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)

from hypothesis import settings  # noqa: E402

from tests.devices import interpreting_triton  # noqa: E402

# Hypothesis: no deadline (time per example is not behaviour, and a loaded 2-core CI machine
# is slow), and a failing example always printed as a reproducible blob. Under CI (CI=true)
# the examples are derandomized: the same examples on every run, so a red build is never luck.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE")
    or ("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first (a stable sort, so each module stays in one piece): under pytest-xdist
    the many quick unit tests then fill the workers' last minutes, instead of a compile or a
    server test of a minute or more running alone at the end while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("triton_cpu") is not None and not interpreting_triton():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1; this process "
                    "compiles them for the GPU "
                    "(tests/unit/kernels/test_triton_reduction.py runs there)")
