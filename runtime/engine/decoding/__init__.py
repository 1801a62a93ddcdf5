"""Decoding one frame's copied records and payload prefix into per-request logprob entries:
what the decoder is told and returns (lanes.py), the frame (frame.py) and one record or
position (position.py)."""
