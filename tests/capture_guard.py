"""A guard for the phases of a step that a captured graph would run: any host read of a
tensor value (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()``, ``bool(t)``, ``int(t)``,
``float(t)``) raises while it is armed; in strict phases so do tensors built from host data
(``torch.tensor``, ``torch.as_tensor``), value-sized outputs (``masked_select``, ``unique``)
and boolean-mask indexing (a nonzero inside ``x[mask]``). ``torch.from_numpy`` is not seen by
a torch-function mode. Also allocation probes for the profiler's memory events. Used by
tests/unit/ranks/test_capture_safe_step.py and test_capture_sample.py."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

FORBIDDEN = {
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.nonzero: "nonzero()",
    torch.nonzero: "torch.nonzero()",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "tensor as an index",
}


HOST_DATA = {
    torch.tensor: "torch.tensor(host data)",
    torch.as_tensor: "torch.as_tensor(host data)",
    torch.masked_select: "masked_select()",
    torch.Tensor.masked_select: "masked_select()",
    torch.unique: "unique()",
    torch.Tensor.unique: "unique()",
}
"""Forbidden in strict phases too: a tensor built from host values (a captured graph would
replay the values of its capture) and ops whose output size depends on tensor values."""

INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
            torch.Tensor.index_put)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSync(AssertionError):
    pass


class HostSyncGuard(TorchFunctionMode):
    """Raises HostSync on a forbidden call while ``depth`` > 0 and no ``allowed`` block
    is open; records each phase it guarded."""

    def __init__(self, strict: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.phase: str | None = None
        self.allowed = 0
        self.guarded: dict[str, int] = {}
        self.strict = set(strict)
        """Phases where HOST_DATA and boolean-mask indexing (a hidden nonzero) raise too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.phase is not None and not self.allowed:
            if func in FORBIDDEN:
                raise HostSync(f"{FORBIDDEN[func]} inside the {self.phase} phase")
            if self.phase in self.strict:
                if func in HOST_DATA:
                    raise HostSync(f"{HOST_DATA[func]} inside the {self.phase} phase")
                if func in INDEXING and len(args) > 1 and _bool_index(args[1]):
                    raise HostSync(f"boolean-mask indexing inside the {self.phase} phase")
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def running(self, phase: str):
        self.guarded[phase] = self.guarded.get(phase, 0) + 1
        previous, self.phase = self.phase, phase
        try:
            with self:
                yield
        finally:
            self.phase = previous

    @contextlib.contextmanager
    def allow(self):
        self.allowed += 1
        try:
            yield
        finally:
            self.allowed -= 1

    def wrap(self, owner: object, name: str, phase: str | None = None) -> None:
        """Run ``owner.name`` under the guard (as ``phase``) from now on."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def guarded(*args, **kwargs):
            with self.running(phase or name):
                return method(*args, **kwargs)

        setattr(owner, name, guarded)

    def exempt(self, owner: object, name: str) -> None:
        """Let ``owner.name`` read tensors on the host even inside a guarded phase."""
        method = getattr(owner, name)

        @functools.wraps(method)
        def exempted(*args, **kwargs):
            with self.allow():
                return method(*args, **kwargs)

        setattr(owner, name, exempted)


def allocated_bytes(call) -> tuple[object, int]:
    """(call's result, bytes of tensor storage the profiler saw it allocate on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    return result, allocated


def retained_bytes(call) -> tuple[object, int]:
    """(call's result, bytes of CPU tensor storage allocated during the call and not freed
    by its end: the profiler's allocations net of its frees)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    return result, sum(e.self_cpu_memory_usage for e in prof.events())
