"""The request side of the OpenAI-compatible API: request models (models.py), the field
policy (refusals.py), chat messages (messages.py), limits checked before parsing (limits.py),
the model's sampling defaults (defaults.py) and the fields -> SamplingParams mapping with the
endpoint-level checks (params.py) and the logprobs wire mode both sides use (wire_mode.py)."""
