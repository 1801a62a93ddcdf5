"""The coordinator's engine: scheduler, executor and frame copies, payload decoding, config."""
