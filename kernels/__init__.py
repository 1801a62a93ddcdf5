"""Pure math on tensors: the packed logprob reduction, sort keys, Philox noise.

Public entry points:
- ``reduce_logprobs``: one rank holds the whole vocabulary row.
- ``reduce_logprobs_sharded``: each rank holds a vocabulary shard; two fixed-width exchanges.
"""

from __future__ import annotations

from kernels.api import reduce_logprobs, reduce_logprobs_sharded

__all__ = ["reduce_logprobs", "reduce_logprobs_sharded"]
