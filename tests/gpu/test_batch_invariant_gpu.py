"""--batch-invariant on a CUDA GPU (BF16): the load-time probe picks a row-invariant matmul
scheme for cuBLAS, and a token row's logits are the same bits alone, in a speculative-style
round and in a busy batch. Skipped without CUDA (scripts/device-check.sh runs it)."""

from __future__ import annotations

import torch

from helios_logprobs.ranks.model import ShardedCausalLM
from tests.devices import gpu_marks
from tests.gpu.checkpoint import write_qwen2

pytestmark = gpu_marks(compiled_triton=False)


def rows(model, tokens: list[int], slot: int, extra: list[tuple[int, list[int]]]):
    ids, positions, slots = list(tokens), list(range(len(tokens))), [slot] * len(tokens)
    for other_slot, other in extra:
        ids += other
        positions += list(range(len(other)))
        slots += [other_slot] * len(other)

    def cuda(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device="cuda")

    return model(cuda(ids), cuda(positions), cuda(slots),
                 torch.arange(len(tokens), device="cuda"))


def test_rows_are_the_same_bits_in_any_batch_on_cuda(tmp_path):
    model = ShardedCausalLM.load(write_qwen2(tmp_path / "qwen2"), device="cuda",
                                 batch_invariant=True)
    model.allocate_cache(3, 256)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    alone = rows(model, prompt, 0, [])
    busy = rows(model, prompt, 1, [(0, [9] * 200), (2, [3, 4])])
    assert torch.equal(alone, busy)
    rows(model, prompt[:4], 2, [])
    decoded = []
    for position in range(4, 7):
        ids = torch.tensor([prompt[position], 11, 12], device="cuda")
        out = model(ids, torch.tensor([position, 201, 3], device="cuda"),
                    torch.tensor([2, 0, 1], device="cuda"), torch.tensor([0], device="cuda"))
        decoded.append(out[0])
    assert torch.equal(torch.stack(decoded), alone[4:])
