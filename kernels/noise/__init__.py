"""Sampling noise: counter-based Philox (philox.py) and its optional compiled CPU kernel."""
