"""What a serving configuration costs per rank: every fixed buffer (buffers.py) and the
capacity report's figures (sizing.py). Above step/ and model/: nothing there imports this."""
