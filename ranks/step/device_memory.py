"""The device allocator's totals for the memory report: allocated, reserved, and the bytes of
the private pools CUDA graphs capture into (counted apart from the frames, whose bytes
sizing.frame_bytes gives).

On CUDA: ``device_memory_allocated`` and ``device_memory_reserved`` are the caching
allocator's totals for the device; ``device_memory_graph_pool`` is the sum of the reserved
segments owned by a private pool (``segment_pool_id`` other than (0, 0): the pools
``torch.cuda.graph`` captures into), 0 until a graph is captured. Serving captures no graph
yet, so a server reports 0 there. On the CPU there is no device allocator: the dict is empty
and the report leaves the fields out.
"""

from __future__ import annotations

import torch

DEFAULT_POOL = (0, 0)


def device_memory(device: torch.device) -> dict[str, int]:
    """The allocator's totals for ``device`` (CUDA), or {} (the CPU)."""
    if device.type != "cuda":
        return {}
    return {"device_memory_allocated": torch.cuda.memory_allocated(device),
            "device_memory_reserved": torch.cuda.memory_reserved(device),
            "device_memory_graph_pool": graph_pool_bytes(device)}


def graph_pool_bytes(device: torch.device) -> int:
    """Reserved bytes of ``device``'s segments owned by private (graph) pools."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # (an older torch: no trace switch)
        segments = torch.cuda.memory_snapshot()
    return sum(segment["total_size"] for segment in segments
               if segment.get("device", index) == index
               and tuple(segment.get("segment_pool_id", DEFAULT_POOL)) != DEFAULT_POOL)
