"""Structured outputs: request-side specs, xgrammar grammars and token bitmasks."""
