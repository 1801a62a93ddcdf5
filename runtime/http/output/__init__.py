"""Engine events to choices: deltas per choice, their merge, the logprobs wire format."""
