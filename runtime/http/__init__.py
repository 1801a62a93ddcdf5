"""The OpenAI-compatible HTTP server: request models (protocol/), one module per endpoint
(endpoints/), choices and the logprobs wire format (output/), the app (server.py)."""
