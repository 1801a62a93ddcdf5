"""One submission on one rank: prepare inputs, forward, sample, commit, reduce.

Every rank runs exactly this for every plan, so the collectives inside the model, the sampler
and the reduction line up. Only the coordinator reads the frames afterwards.

- ``inputs``: the plan -> token/position/slot tensors, slot states, admission records, the
  logprob lanes (``prepare_inputs``).
- ``reduce``: the gated logprob reduction bound to the completion bundle (``StepReduction``).
- ``rank_step``: ``RankStep``, whose ``run`` reads phase -> phase -> phase.
"""

from __future__ import annotations

from helios_logprobs.ranks.step.config import StepConfig
from helios_logprobs.ranks.step.rank_step import RankStep

__all__ = ["RankStep", "StepConfig"]
