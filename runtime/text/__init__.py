"""Text presentation: token bytes, incremental detokenizer, stop strings, chat templates."""
