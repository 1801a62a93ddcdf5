"""Building a rank and, on the coordinator, the engine on top of it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ranks.core import capabilities
from ranks.model import ShardedCausalLM
from ranks.plan import StepPlan
from ranks.step import RankStep, StepConfig
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.client import EngineInfo


@dataclass(frozen=True)
class RuntimeConfig:
    model_dir: Path
    capacity: int = 16
    max_model_len: int | None = None
    """None: the checkpoint's max_position_embeddings, capped at 4096."""
    chunk_size: int = 256
    logprobs: bool = True
    """False exports a core without logprob buffers (K=0): logprob requests get HTTP 400."""
    reduction_backend: str = "torch"
    served_model_name: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.reduction_backend not in ("torch", "triton"):
            raise ValueError(f"reduction_backend: torch or triton, not {self.reduction_backend}")


def eos_token_ids(model_dir: Path, from_config: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (chat models often add their
    end-of-turn token there, e.g. Qwen2's <|im_end|>), in first-seen order."""
    ids = list(from_config)
    path = model_dir / "generation_config.json"
    if path.is_file():
        extra = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        for token in extra if isinstance(extra, list) else [extra]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


def load_rank(config: RuntimeConfig, group) -> RankStep:
    model = ShardedCausalLM.load(config.model_dir, group, device=torch.device(config.device))
    limit = config.max_model_len or min(model.config.max_position_embeddings, 4096)
    step_config = StepConfig(
        capacity=config.capacity,
        max_seq_len=limit,
        reduction_backend=config.reduction_backend,
    )
    return RankStep(model, group, step_config, device=config.device)


def build_engine(
    config: RuntimeConfig, step: RankStep, broadcast: Callable[[StepPlan], None] | None = None
) -> Engine:
    caps = capabilities(step.outputs, config.logprobs)
    model = step.model
    info = EngineInfo(
        model_name=config.served_model_name or Path(config.model_dir).name,
        vocab_size=model.vocab_size,
        max_model_len=step.config.max_seq_len,
        max_logprobs=caps.k,
        supports_token_ids=caps.supports_token_ids,
        eos_token_ids=eos_token_ids(Path(config.model_dir), model.config.eos_token_ids),
    )
    engine_config = EngineConfig(
        capacity=config.capacity,
        max_seq_len=step.config.max_seq_len,
        chunk_size=config.chunk_size,
        max_batched_tokens=max(config.chunk_size, config.capacity) * 2,
    )
    return Engine(step, info, engine_config, broadcast)
