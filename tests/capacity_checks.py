"""Checks shared by the capacity tests (TP1 in process, TP2/TP4 over gloo): the report
(ranks/capacity/sizing.py) against the tensors a real rank and engine hold."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from helios_logprobs.ranks.capacity.buffers import Buffer
from helios_logprobs.ranks.capacity.sizing import RankSizing, rank_sizing
from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.step import RankStep
from helios_logprobs.runtime.engine.bootstrap import load_rank
from helios_logprobs.runtime.engine.config import RuntimeConfig

REPO = Path(__file__).resolve().parents[1]
OUR_PACKAGE = "helios_logprobs"

# ------------------------------------------------------------------------------------------
# Reality: the tensors an object graph holds
# ------------------------------------------------------------------------------------------


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return str(t.device), s.data_ptr()


def reachable_storages(*roots: object) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from ``roots`` through this project's objects and
    containers (attributes, lists, tuples, dicts): storage -> physical bytes."""
    seen: set[int] = set()
    out: dict[tuple[str, int], int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out[storage_key(obj)] = obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif (type(obj).__module__ or "").split(".")[0] == OUR_PACKAGE:
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return out


def resolve(root: object, path: str) -> list[torch.Tensor]:
    """The tensors at ``path`` (``a.b[2].c``, ``[*]`` = every element or dict value)."""
    objs = [root]
    for part in re.findall(r"\[[^\]]*\]|[^.\[\]]+", path):
        nxt = []
        for o in objs:
            if part == "[*]":
                nxt.extend(o.values() if isinstance(o, dict) else o)
            elif part.startswith("["):
                nxt.append(o[int(part[1:-1])])
            else:
                nxt.append(getattr(o, part))
        objs = nxt
    assert all(isinstance(o, torch.Tensor) for o in objs), (path, [type(o) for o in objs])
    return objs


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_buffers(root: object, buffers: tuple[Buffer, ...]) -> set[tuple[str, int]]:
    """Each path's tensors have exactly the report's shapes, dtypes and physical bytes;
    returns the storages the report covers."""
    by_path: dict[str, list[Buffer]] = {}
    for b in buffers:
        by_path.setdefault(b.path, []).append(b)
    covered = set()
    for path, listed in by_path.items():
        tensors = resolve(root, path)
        want = Counter()
        for b in listed:
            want[(b.shape, b.dtype)] += b.count
        got = Counter((tuple(t.shape), short(t.dtype)) for t in tensors)
        assert got == want, (path, got, want)
        shared = [b for b in listed if b.shares is not None]
        if shared:
            owner = {storage_key(t) for t in resolve(root, shared[0].shares)}
            assert {storage_key(t) for t in tensors} == owner, path
            continue
        storages = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
        assert len(storages) == len(tensors), f"{path}: tensors share storage"
        assert sum(storages.values()) == sum(b.nbytes for b in listed), path
        assert not covered & storages.keys(), f"{path}: storage listed twice"
        covered |= storages.keys()
    return covered


def check_rank(step, sizing: RankSizing) -> None:
    """The report of one rank equals what its RankStep holds, buffer by buffer and in
    total (nothing reachable from the step is missing from the report)."""
    device = (*sizing.buffers, *sizing.kv_cache)
    covered = check_buffers(step, device)
    reachable = reachable_storages(step)
    missing = {k: v for k, v in reachable.items() if k not in covered}
    assert not missing, f"tensors the report does not list: {missing}"
    assert covered == reachable.keys()
    # (the step's pinned upload twin is host memory; the staging frame is the executor's)
    assert sum(reachable.values()) == (sizing.device_bytes - sizing.staging_bytes
                                       + sizing.pinned_bytes)
    for name, section in (("completion", "completion"), ("scoring", "scoring")):
        assert sizing.section_bytes(section) == sum(
            b.nbytes for b in sizing.buffers if b.section == name)


def check_kv_allocator(model, sizing: RankSizing, capacity: int, length: int) -> None:
    cache = model.allocate_cache(capacity, length)
    held = sum(t.untyped_storage().nbytes() for t in (*cache.keys, *cache.values))
    assert held == sizing.kv_bytes_per_token * capacity * length


def check_host(engine, step, sizing: RankSizing) -> None:
    """The coordinator's host frames (executor, prompt reader) equal the report's."""
    covered = check_buffers(engine, sizing.host)
    host = reachable_storages(engine.executor, engine.prompts).keys() - reachable_storages(
        step).keys()
    assert covered == host
    assert sum(t for k, t in reachable_storages(engine.executor, engine.prompts).items()
               if k in host) == sizing.host_bytes + sizing.staging_bytes


# ------------------------------------------------------------------------------------------
# TP1 ranks in process


def build(model_dir: Path, speculative_tokens: int = 0, group: object = None, **overrides
          ) -> tuple[RuntimeConfig, RankStep]:
    """runtime.engine.bootstrap.load_rank; with speculative rounds (N proposals, so
    capacity x (1 + N) sampling rows) the same rank built from the StepConfig."""
    settings = dict(model_dir=model_dir, capacity=3, max_model_len=64, chunk_size=256)
    config = RuntimeConfig(**{**settings, **overrides})
    if not speculative_tokens:
        return config, load_rank(config, group)
    model = ShardedCausalLM.load(model_dir, group)
    step = config.step_config(config.resolve_max_model_len(model.config))
    return config, RankStep(model, group, replace(step, speculative_tokens=speculative_tokens))


def sizing_of(step, interpreted: bool = False) -> RankSizing:
    return rank_sizing(step.model.config, step.config, 1, 0, step.model.dtype, interpreted,
                       cuda=step.device.type == "cuda")
