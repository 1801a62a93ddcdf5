"""The route handlers: Completions, Chat Completions, Responses, tokenize/detokenize."""
