"""Finding the processes of a torchrun job (for tests that kill or stop one rank)."""

from __future__ import annotations

import os
from pathlib import Path


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def rank_pid(root_pid: int, rank: int) -> int:
    """The torchrun worker with RANK=rank among root_pid's descendants (torchrun starts each
    worker in a session of its own, so the parent chain is what links them)."""
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() not in environ:
                continue
            ancestor = pid
            for _ in range(4):
                ancestor = parent_pid(ancestor)
                if ancestor == root_pid:
                    return pid
        except (OSError, ValueError, IndexError):
            continue
    raise LookupError(f"no rank {rank} under {root_pid}")
