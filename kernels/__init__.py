"""Pure math on tensors: the packed logprob reduction (kernels.api), sort keys, Philox noise."""
