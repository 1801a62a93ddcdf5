"""Output parsers: reasoning and tool calls, incremental over the detokenizer's text, each
content event with the source range of generated text it came from (events.py)."""
