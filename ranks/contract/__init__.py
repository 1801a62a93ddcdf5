"""The logprob contract's side of a rank: ABI6 records, the CompletionOutputs bundle, the
core's declarations and their validation, the upload protocol, the one request check, and
the size of every buffer (the capacity report)."""
