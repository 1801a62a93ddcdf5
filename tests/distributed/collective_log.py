"""Record every collective that actually runs in this process, with its tensors' shapes.

``record_collectives()`` is a context manager for code running inside a rank (see
tests/distributed/harness.py). It sees each collective at the dispatcher, where every route
ends: ``torch.distributed``'s functions (all_reduce, all_gather, all_gather_into_tensor /
all_gather_single, broadcast, all_gather_object, barrier, ...), the process group's own
methods (``group.allgather(...)``) and anything built on them all issue ``c10d::`` operators
(``allreduce_``, ``allgather_``, ``_allgather_base_``, ``broadcast_``, ...), which a
TorchDispatchMode intercepts. So the log does not depend on the code under test reporting
its own traffic (``WordExchange.bytes_sent`` is computed from its own shapes), and a stray
all-gather of a vocabulary row cannot hide.

Each entry also names the outermost ``torch.distributed`` function it ran under (``api``;
None when a ProcessGroup method was called directly), so set-up traffic such as
``all_gather_object`` reads as such.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PUBLIC_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "all_gather_coalesced", "all_reduce", "all_reduce_coalesced", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)


@dataclass(frozen=True)
class Collective:
    op: str
    """The c10d operator without its namespace: "allreduce_", "_allgather_base_", ..."""
    api: str | None
    """The outermost torch.distributed function that issued it (None: a group method)."""
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    """(shape, dtype) of every tensor argument, outputs included, in argument order."""

    @property
    def dims(self) -> list[int]:
        return [d for shape, _ in self.tensors for d in shape]

    @property
    def dtypes(self) -> set[torch.dtype]:
        return {dtype for _, dtype in self.tensors}

    def shapes(self) -> list[tuple[int, ...]]:
        return [shape for shape, _ in self.tensors]


class _Mode(TorchDispatchMode):
    def __init__(self, log: list[Collective], api_stack: list[str]) -> None:
        super().__init__()
        self.log = log
        self.api_stack = api_stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("c10d::"):
            leaves, _ = tree_flatten((args, kwargs))
            tensors = tuple(
                (tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)
            )
            api = self.api_stack[0] if self.api_stack else None
            self.log.append(Collective(name[len("c10d::"):], api, tensors))
        return func(*args, **kwargs)


@contextmanager
def record_collectives() -> Iterator[list[Collective]]:
    """Yield a list that fills with every collective run in this thread until exit."""
    log: list[Collective] = []
    api_stack: list[str] = []
    owner = threading.get_ident()
    saved: list[tuple[object, str, object]] = []

    def labelled(name: str, fn):
        def wrapper(*args, **kwargs):
            if threading.get_ident() != owner:
                return fn(*args, **kwargs)
            api_stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                api_stack.pop()

        return wrapper

    for name in PUBLIC_COLLECTIVES:
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is not None:
                saved.append((module, name, fn))
                setattr(module, name, labelled(name, fn))
    try:
        with _Mode(log, api_stack):
            yield log
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
