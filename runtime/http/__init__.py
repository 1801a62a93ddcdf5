"""The OpenAI-compatible HTTP server: request models, wire formats, one module per endpoint."""
