"""The forward phase compiled (--compile): the model's ``forward_tokens`` as one
``torch.compile(fullgraph=True)`` graph over a padded token batch, and its variants.

Two graphs, dynamic sizes, no recompilation. Every submission is padded to a bucket of a
fixed ladder (1, 2, 4, 8, ... up to the step's token budget): the padding is what a CUDA
graph captures per bucket. Buckets >= 2 share one graph whose token count N is marked
dynamic (>= 2: dynamo specialises 0 and 1); a single token has its own graph (N = 1 static),
because padding it to 2 rows doubled the CPU's matmul time (MKL's one-row path; SmolLM2's
batch-1 decode ran at 0.68x eager). The key length L (the batch's
longest context, at least 2, at most max_seq_len) is dynamic too: each token gathers its own
slot's keys at positions 0..L-1 by index (``cache[slots[:, None], key_positions[None]]``: a
slice would guard on L == max_seq_len) and masks those past its position. Padding tokens
write their keys to a spare cache slot (index ``capacity``) at position 0 and read only it,
so neither the warm-up nor padding ever touches a serving slot.

Which submissions run compiled is a host decision made with the inputs: the per-token key
gather costs N x L rows, so the graph takes a batch whose padded N x L is at most the
largest decode bucket's at full length (every decode and speculative batch; prefill chunks
while their context is short). Larger prefill batches run the eager planned forward (one
attention call per chunk), as does ``batch_invariant`` (its attention and ordered sums are
its own). Every variant runs once at start-up (the compile, then each bucket's guards), so
nothing compiles while serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_TOKENS = 2
"""The smallest dynamic size: dynamo specialises 0 and 1 (bucket 1 is its own graph)."""
MAX_SIZE = 1 << 24
"""The dynamic sizes' declared upper bound, the same for every step (see ``_call``)."""


def token_buckets(decode_rows: int, token_budget: int) -> tuple[int, ...]:
    """The ladder 1, 2, 4, 8, ... through the first bucket >= decode_rows, then on to the
    token budget (the last bucket is the budget itself when it is not a power of two)."""
    top = max(token_budget, decode_rows, MIN_TOKENS)
    buckets, size = [1], MIN_TOKENS
    while size < top:
        buckets.append(size)
        size *= 2
    buckets.append(top)
    return tuple(buckets)


@dataclass
class ForwardVariant:
    """One bucket of the compiled forward: static inputs and a ``run()`` that reads only them.

    ``token_ids``, ``positions``, ``slots`` are int64 views ``[tokens]`` of the graph's
    buffers (the same addresses every step: a CUDA graph can capture ``run``);
    ``key_length`` is the one host value, the dynamic L (a capture pins it at max_seq_len,
    where the mask alone bounds each row's context). ``run`` returns the final-normed hidden
    state of every token, ``[tokens, hidden]``."""

    tokens: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor
    """int64 arange(max_seq_len): the first ``key_length`` are the gathered key positions."""
    fn: object = field(repr=False)
    key_length: int = MIN_TOKENS

    def run(self) -> torch.Tensor:
        with torch.no_grad():
            return self.fn(self.token_ids, self.positions, self.slots,
                           self.key_positions[: self.key_length])


class ForwardGraph:
    def __init__(self, model, capacity: int, max_seq_len: int, decode_rows: int,
                 token_budget: int, device: torch.device, compile: bool = True) -> None:
        """``model``: the ShardedCausalLM, its cache allocated with one spare slot."""
        if model.cache is None or model.cache.keys[0].shape[0] < capacity + 1:
            raise ValueError("the compiled forward needs the cache's spare slot "
                             "(allocate_cache(..., spare_slots=1))")
        self.model = model
        self.max_seq_len = max_seq_len
        self.pad_slot = capacity
        self.buckets = token_buckets(decode_rows, token_budget)
        decode_top = next(b for b in self.buckets if b >= decode_rows)
        self.gather_limit = decode_top * max_seq_len
        """The most padded tokens x key length the graph takes (decode's worst case)."""
        top = self.buckets[-1]
        self.token_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.full((top,), capacity, dtype=torch.int64, device=device)
        self.key_positions = torch.arange(max_seq_len, dtype=torch.int64, device=device)
        fn = model.forward_tokens
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False) if compile else fn
        self.variants = {b: ForwardVariant(b, self.token_ids[:b], self.positions[:b],
                                           self.slots[:b], self.key_positions, self._call)
                         for b in self.buckets}
        self._marked: set[bool] = set()
        """Which graphs were compiled: False for the single token's, True for the batch's."""
        for variant in self.variants.values():  # compile, then every bucket's guards
            variant.run()

    def _call(self, token_ids, positions, slots, key_positions) -> torch.Tensor:
        batch = token_ids.shape[0] >= MIN_TOKENS
        if batch not in self._marked:  # each graph's first call compiles it
            # (One bound for every configuration: a bound becomes a guard of the cached
            # graph, and Inductor's cache, keyed without it, hands that guard to the next
            # process that traces the same graph, whatever its own bound.)
            for tensor in (token_ids, positions, slots, key_positions)[0 if batch else 3:]:
                torch._dynamo.mark_dynamic(tensor, 0, min=MIN_TOKENS, max=MAX_SIZE)
            self._marked.add(batch)
        return self.fn(token_ids, positions, slots, key_positions)

    def select(self, host: tuple[list[int], list[int], list[int], list[int]]
               ) -> ForwardVariant | None:
        """Prepare's choice for a batch given as host lists (ids, positions, slots, rows): its
        variant with ``key_length`` set, or None for the eager forward."""
        ids, positions = host[0], host[1]
        if not ids:
            return None
        bucket = next((b for b in self.buckets if b >= len(ids)), None)
        key_length = max(max(positions) + 1, MIN_TOKENS)
        if bucket is None or bucket * key_length > self.gather_limit:
            return None
        variant = self.variants[bucket]
        variant.key_length = key_length
        return variant

    def load(self, variant: ForwardVariant, token_ids: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor) -> None:
        """Copy the step's input views into the variant's buffers (device copies, no host
        read) and reset the padding to the spare slot at position 0."""
        n = token_ids.shape[0]
        self.token_ids[:n].copy_(token_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.token_ids[n : variant.tokens].zero_()
        self.positions[n : variant.tokens].zero_()
        self.slots[n : variant.tokens].fill_(self.pad_slot)
