"""The sampler's radix select (top-p, top-k > 256) over CPU rows in compiled code."""
