"""What the reduction is asked for each row: one record instead of five repeated arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowRequest:
    """Per-row inputs of a reduction over ``rows`` logit rows (all on the logits' device).

    chosen     int32/int64 [rows]: the sampled token's global id
    ids        int32 [rows, 128]: selected ids, caller order (ignored where counts is 0)
    counts     int32 [rows]: number of selected ids; 0 selects the K natural alternatives
    requested  int32 [rows]: 0 = the row is neither read nor written
    k          natural alternatives to store, 0..EXPORT_K
    """

    chosen: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    requested: torch.Tensor
    k: int
