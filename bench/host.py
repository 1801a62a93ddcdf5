"""The host's stolen CPU time, from /proc/stat: on a shared virtual machine, time the
hypervisor gave to other guests. A run that lost a large share of its CPU to steal measures
the neighbours, not the code, so the benchmarks print it next to their ratios."""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL = 7
"""Index of `steal` among the aggregate line's counters (user nice system idle iowait irq
softirq steal ...)."""


def cpu_counters() -> list[int] | None:
    """The aggregate `cpu` line's counters (clock ticks since boot), or None off Linux."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) <= STEAL + 1:
        return None
    return [int(value) for value in fields[1:]]


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of all CPU time between two readings that was stolen (None when unknown).
    Guest time is already counted in user and nice, so only the first eight counters add
    up to the total."""
    if before is None or after is None:
        return None
    deltas = [b - a for a, b in zip(before[: STEAL + 1], after[: STEAL + 1], strict=True)]
    total = sum(deltas)
    return deltas[STEAL] / total if total > 0 else None


def share_text(share: float | None) -> str:
    """A steal share as the benchmarks print it ("-" when unknown)."""
    return "-" if share is None else f"{share:.0%}"
