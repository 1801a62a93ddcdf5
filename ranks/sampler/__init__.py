"""The sharded sampler, one file per step in vLLM v1's order: params.py (per-row parameters),
processors.py (allowed ids, blocked ids, logit bias, penalties), filters.py (top-k, top-p,
min-p thresholds through small exchanges), gumbel.py (Gumbel-max with Philox noise) and
sampler.py (the step that runs them and the global pick)."""
