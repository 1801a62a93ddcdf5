"""The coordinator's engine: scheduler, executor with frame copies, payload decoding, configuration."""
