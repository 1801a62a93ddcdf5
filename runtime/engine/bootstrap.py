"""Building a rank and, on the coordinator, the engine on top of it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.dtype import DTYPES, resolve_dtype
from helios_logprobs.ranks.model.weights import LoadProgress
from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.ranks.step import RankStep
from helios_logprobs.runtime.engine.client import EngineInfo
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.engine.engine import Engine
from helios_logprobs.runtime.structured.backend import LazyGrammarBackend


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


def load_rank(config: RuntimeConfig, group, progress: LoadProgress | None = None) -> RankStep:
    """This rank's model shard and step; ``progress(done, total)`` follows the weight load."""
    name, _ = resolve_dtype(config.dtype, config.device, config.model_dir)
    model = ShardedCausalLM.load(config.model_dir, group, device=torch.device(config.device),
                                 dtype=DTYPES[name], progress=progress,
                                 batch_invariant=config.batch_invariant)
    limit = config.resolve_max_model_len(model.config)
    return RankStep(model, group, config.step_config(limit), device=config.device)


def build_engine(
    config: RuntimeConfig, step: RankStep, broadcast: Callable[[StepPlan], None] | None = None
) -> Engine:
    caps = step.capabilities
    model = step.model
    scheduler = config.scheduler_config(step.config.max_seq_len)
    info = EngineInfo(
        model_name=config.model_name,
        vocab_size=model.vocab_size,
        max_model_len=step.config.max_seq_len,
        max_logprobs=caps.k,
        supports_token_ids=caps.supports_token_ids,
        eos_token_ids=eos_token_ids(Path(config.model_dir), model.config.eos_token_ids),
        prompt_logprobs=caps.prompt_scoring,
        reasoning=scheduler.reasoning,
    )
    pending = config.max_pending_frames * step.outputs.token_capacity
    engine = Engine(step, info, scheduler, broadcast, max_pending_events=pending)
    engine.model_dir = str(config.model_dir)
    # Structured outputs: xgrammar over the served tokenizer, built on first use.
    engine.scheduler.grammars = LazyGrammarBackend(config.model_dir, info.vocab_size,
                                                   info.eos_token_ids)
    return engine
