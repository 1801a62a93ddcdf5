"""Prompt scoring on vocabulary shards: the step functions (steps.py) and their driver."""
