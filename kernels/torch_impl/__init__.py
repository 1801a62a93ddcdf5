"""The torch reduction: tile by tile (tiles.py), its CPU fast path (lean*.py), the sharded
steps (sharded.py) and the entry point (backend.py)."""
