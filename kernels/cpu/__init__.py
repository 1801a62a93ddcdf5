"""The CPU reduction: tile by tile (tiles.py), its fast paths (lean*.py, compiled.py and its
C sources), the sharded steps (sharded.py) and the entry point (backend.py)."""
