"""The engine core and its API server processes: typed messages, the core's endpoint, and
the engine as an API server sees it (issue 35)."""
