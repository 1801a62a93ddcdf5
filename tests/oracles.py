"""Independent oracles shared by unit and distributed tests.

- Model: random tiny Llama/Qwen2 checkpoints saved with transformers, a mixed prefill/decode
  schedule, and transformers' own FP32 logits for it (the reference the sharded model must
  match at TP1, TP2 and TP4).
- Reduction: a float64 log-softmax over the real vocabulary, ranked by (value desc, id asc),
  that shares no code with kernels/; packed payload rows are checked against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from helios_logprobs.ranks.model import ShardedCausalLM

# ----------------------------------------------------------------------------- model
TOLERANCE = 1e-4


SEQUENCES = {"a": (2, 6, 4), "b": (0, 9, 4), "c": (2, 3, 2)}
"""name -> (slot, prompt length, decode steps). "c" reuses "a"'s slot after "a" ends."""


def llama_kwargs() -> dict:
    return dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )


def qwen2_kwargs() -> dict:
    return dict(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )


SCALED_ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}
"""RoPE scalings with an original length short enough that the schedule's positions (< 16)
rotate differently from plain RoPE in every one of them."""


def qwen3_kwargs() -> dict:
    """q/k norms, head_dim 32 while hidden / heads is 16, a vocabulary 4 does not divide."""
    return dict(qwen2_kwargs(), vocab_size=299, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, tie_word_embeddings=False)


def mistral_kwargs() -> dict:
    """A sliding window that the test schedule's 32-token cache never exceeds."""
    kwargs = {k: v for k, v in llama_kwargs().items() if not k.endswith("_bias")}
    return dict(kwargs, sliding_window=32, head_dim=16)


FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", llama_kwargs),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", qwen2_kwargs),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", qwen3_kwargs),
    "mistral": ("MistralConfig", "MistralForCausalLM", mistral_kwargs),
}


def build_checkpoint(
    path: Path, family: str, max_shard_size: str | None = None, rope: str | None = None
) -> Path:
    """Random tiny checkpoint saved with transformers; every parameter (biases too) is random.
    ``family``: a key of FAMILIES; ``rope``: a key of SCALED_ROPES."""
    import transformers

    config_name, model_name, make_kwargs = FAMILIES[family]
    kwargs = make_kwargs()
    if rope is not None:
        kwargs["rope_parameters"] = dict(SCALED_ROPES[rope], rope_theta=kwargs.pop("rope_theta"))
    config = getattr(transformers, config_name)(**kwargs)
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def sequence_tokens(vocab_size: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {
        name: torch.randint(0, vocab_size, (prompt + decode,), generator=gen).tolist()
        for name, (_, prompt, decode) in SEQUENCES.items()
    }


def reference_logits(model_dir: Path, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return {name: model(torch.tensor([ids])).logits[0].float() for name, ids in tokens.items()}


@dataclass(frozen=True)
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logit_indices: torch.Tensor
    expected: list[tuple[str, int]]


def schedule(tokens: dict[str, list[int]]) -> list[Step]:
    """Mixed prefill/decode steps: whole prefill, two-chunk prefill, interleaved decodes."""
    segments: list[list[tuple[str, int, int]]] = [
        [("a", 0, 6), ("b", 0, 5)],
        [("b", 5, 9), ("a", 6, 7)],
        [("a", 7, 8), ("b", 9, 10)],
        [("b", 10, 11), ("a", 8, 9)],
        [("a", 9, 10), ("b", 11, 12)],
        [("c", 0, 3), ("b", 12, 13)],
        [("c", 3, 4)],
        [("c", 4, 5)],
    ]
    steps = []
    for number, parts in enumerate(segments):
        ids, pos, slots, rows = [], [], [], []
        for name, start, end in parts:
            ids += tokens[name][start:end]
            pos += list(range(start, end))
            slots += [SEQUENCES[name][0]] * (end - start)
            rows += [(name, p) for p in range(start, end)]
        order = list(range(len(ids)))
        if number % 2:
            order = order[::-1][: max(1, len(order) - 1)]
        steps.append(
            Step(
                input_ids=torch.tensor(ids, dtype=torch.int64),
                positions=torch.tensor(pos, dtype=torch.int64),
                slots=torch.tensor(slots, dtype=torch.int64),
                logit_indices=torch.tensor(order, dtype=torch.int64),
                expected=[rows[i] for i in order],
            )
        )
    return steps


def run_schedule(model: ShardedCausalLM, tokens: dict[str, list[int]]) -> list[torch.Tensor]:
    model.allocate_cache(capacity=3, max_seq_len=32)
    return [
        model.forward(s.input_ids, s.positions, s.slots, s.logit_indices) for s in schedule(tokens)
    ]


def expected_rows(step: Step, reference: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([reference[name][pos] for name, pos in step.expected])


def check_natural(
    pairs: list[tuple[int, float]], row: torch.Tensor, n: int, tol: float = TOLERANCE
) -> None:
    """`pairs` is a valid natural top-n of `row`: values match, order by (value desc, id asc),
    and nothing left out is larger (within tolerance, so near-ties may go either way)."""
    assert len(pairs) == min(n, row.numel())
    for token_id, value in pairs:
        assert abs(value - float(row[token_id])) <= tol, (token_id, value)
    for (id_a, a), (id_b, b) in zip(pairs, pairs[1:], strict=False):
        assert a > b or (a == b and id_a < id_b)
    if pairs and len(pairs) < row.numel():
        rest = row.clone()
        rest[[t for t, _ in pairs]] = float("-inf")
        assert float(rest.max()) <= pairs[-1][1] + tol


# ----------------------------------------------------------------------------- reduction
WORDS = 258


EPS32 = 2.0**-23


def oracle(x: torch.Tensor, vocab: int) -> tuple[torch.Tensor, float] | None:
    """float64 reported values of one row, and its lse; None when the lse is not finite."""
    v = x[:vocab].to(torch.float64)
    if bool(torch.isnan(v).any()) or bool((v == math.inf).any()) or bool((v == -math.inf).all()):
        return None
    lse = float(torch.logsumexp(v, 0))
    return v - lse, lse


LSE_EPS = 8
"""The FP32 normalizer's error in units of EPS32 * max(1, |lse|). Measured: under 1 for the
torch and reference backends over every kind of row in
tests/unit/kernels/test_reduction_torch.py."""


def tolerance(lse: float, want):
    """Error bound of a reported FP32 value (float32 logit minus the FP32 lse, rounded) against
    the float64 value ``want`` = x - lse: the normalizer's error, at the scale of the lse, plus
    the rounding of the result (an ulp of |want|). It never grows with the largest logit: a row
    holding a -1e30 logit still has its other values checked to ~1e-6."""
    if isinstance(want, torch.Tensor):
        return LSE_EPS * EPS32 * max(1.0, abs(lse)) + EPS32 * want.abs()
    return LSE_EPS * EPS32 * max(1.0, abs(lse)) + EPS32 * abs(want)


def f32_values(bits: list[int]) -> list[float]:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).tolist()


def check_row(
    words: torch.Tensor, x: torch.Tensor, vocab: int, chosen: int, k: int, ids: list[int]
) -> None:
    """One packed row against the float64 oracle (see the module docstring)."""
    w = words.tolist()
    assert len(w) == WORDS and w[0] == chosen
    ref = oracle(x, vocab)
    pair_ids, pair_vals = w[2::2], f32_values(w[3::2])
    if ref is None:
        assert math.isnan(f32_values([w[1]])[0]), "non-finite lse must give a NaN chosen value"
        assert all(-1 <= i < vocab for i in pair_ids)
        return
    v64, lse = ref

    def tol(want: float) -> float:
        return tolerance(lse, want)

    def close(got: float, want: float) -> bool:
        return got == want if math.isinf(want) else abs(got - want) <= tol(want)

    assert close(f32_values([w[1]])[0], float(v64[chosen])), (w[1], float(v64[chosen]))
    if ids:
        n = len(ids)
        assert pair_ids[:n] == ids
        for i, got in zip(ids, pair_vals[:n], strict=True):
            assert close(got, float(v64[i])), (i, got, float(v64[i]))
        assert all(t == -1 for t in w[2 + 2 * n :])
        return
    real = min(k, vocab)
    got_ids, got_vals = pair_ids[:real], pair_vals[:real]
    assert all(t == -1 for t in w[2 + 2 * real :]), "unused words must be -1"
    assert len(set(got_ids)) == real and all(0 <= i < vocab for i in got_ids)
    for a, b, ia, ib in zip(got_vals, got_vals[1:], got_ids, got_ids[1:], strict=False):
        assert a > b or (a == b and ia < ib), "order: value desc, then id asc"
    for i, got in zip(got_ids, got_vals, strict=True):
        assert close(got, float(v64[i])), (i, got, float(v64[i]))
    order = torch.sort(v64, descending=True, stable=True)
    want_vals = order.values.tolist()
    want_ids = order.indices.tolist()
    for j in range(real):
        assert close(got_vals[j], want_vals[j]), (j, got_vals[j], want_vals[j])
        above = want_vals[j - 1] - want_vals[j] if j else math.inf
        below = want_vals[j] - want_vals[j + 1] if j + 1 < vocab else math.inf
        margin = 2 * tol(want_vals[j]) if math.isfinite(want_vals[j]) else 0.0
        if above > margin and below > margin:
            assert got_ids[j] == want_ids[j], (j, got_ids, want_ids[:real])
    if real:
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[got_ids] = False
        if bool(rest.any()):
            best_left = float(v64[rest].max())
            slack = tol(best_left) if math.isfinite(best_left) else 0.0
            assert best_left <= got_vals[-1] + slack, "a better id was skipped"


def check_payload(out, logits, vocab, chosen, k, token_ids, requested) -> None:
    for row in range(out.shape[0]):
        if requested is None or int(requested[row]):
            ids = token_ids[row] if token_ids else []
            check_row(out[row], logits[row], vocab, int(chosen[row]), k, ids)
