"""Tensor-parallel Llama / Qwen2 forward over a flattened varlen batch with a per-slot KV cache.

The math follows transformers: RMSNorm in FP32 then cast, rotate-half RoPE with FP32 angles,
SiLU-gated MLP, GQA, pre-norm residuals. Row-parallel outputs are summed over the group; logits
stay vocabulary-sharded (``[rows, local_width]``, padded lanes hold garbage the caller masks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from helios_logprobs.collectives.groups import (
    all_reduce_sum,
    all_reduce_sum_ordered,
    group_rank,
    group_size,
)
from helios_logprobs.collectives.ops import all_reduce_sum as all_reduce_sum_op
from helios_logprobs.collectives.ops import group_name
from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.errors import UnsupportedModelError
from helios_logprobs.ranks.model.invariant import attention as invariant_attention
from helios_logprobs.ranks.model.invariant import choose_linear
from helios_logprobs.ranks.model.rope import inverse_frequencies
from helios_logprobs.ranks.model.sharding import ShardLayout, shard_layout
from helios_logprobs.ranks.model.weights import (
    LayerWeights,
    LoadProgress,
    ShardWeights,
    load_shard_weights,
)


@dataclass(frozen=True)
class KVCache:
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    capacity: int
    max_seq_len: int

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_seq_len < 1:
            raise ValueError(f"cache needs capacity and max_seq_len >= 1, got {self}")


@dataclass(frozen=True)
class _AttentionPlan:
    single_rows: torch.Tensor | None
    single_slots: torch.Tensor | None
    single_mask: torch.Tensor | None
    single_len: int
    chunks: tuple[tuple[torch.Tensor, int, torch.Tensor, int], ...]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ShardedCausalLM:
    def __init__(
        self,
        config: ModelConfig,
        layout: ShardLayout,
        weights: ShardWeights,
        group: object | None,
        device: torch.device,
        dtype: torch.dtype,
        batch_invariant: bool = False,
    ) -> None:
        self.config = config
        self.layout = layout
        self.weights = weights
        self.group = group
        self.device = device
        self.dtype = dtype
        self.cache: KVCache | None = None
        hd = config.head_dim
        inv_freq, self.rotary_scale = inverse_frequencies(hd, config.rope_theta,
                                                          config.rope_scaling)
        self.inv_freq = inv_freq.to(device)
        self._q_width = layout.local_heads * hd
        self._kv_width = layout.local_kv_heads * hd
        self.batch_invariant = batch_invariant
        self._linear = choose_linear(self._linears()) if batch_invariant else F.linear
        self._reduce = all_reduce_sum_ordered if batch_invariant else all_reduce_sum
        self._group_name = group_name(group)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        group: object | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        progress: LoadProgress | None = None,
        batch_invariant: bool = False,
    ) -> ShardedCausalLM:
        """Load this rank's shard; ``dtype`` defaults to FP32 on CPU and BF16 elsewhere.
        ``progress(done, total)`` follows the load (see ``load_shard_weights``);
        ``batch_invariant``: see ``ranks.model.invariant``."""
        device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        config = ModelConfig.from_model_dir(model_dir)
        layout = shard_layout(config, group_size(group), group_rank(group))
        weights = load_shard_weights(model_dir, config, layout, device, dtype, progress)
        return cls(config, layout, weights, group, device, dtype, batch_invariant)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def vocab_start(self) -> int:
        return self.layout.vocab_start

    @property
    def local_width(self) -> int:
        return self.layout.local_width

    @property
    def local_valid(self) -> int:
        return self.layout.local_valid

    @property
    def padded_vocab(self) -> int:
        return self.layout.padded_vocab

    def allocate_cache(self, capacity: int, max_seq_len: int, spare_slots: int = 0) -> KVCache:
        """Per layer K and V of shape ``[capacity + spare_slots, max_seq_len, local_kv_heads,
        head_dim]``; the cache serves slots [0, capacity); a spare slot takes the writes of a
        compiled forward's padding tokens (ranks/step/forward_graph.py)."""
        window = self.config.sliding_window
        if window is not None and max_seq_len > window:
            raise UnsupportedModelError(
                f"sliding-window attention is not implemented: this checkpoint's "
                f"sliding_window={window} would bind beyond {window} tokens, so max_model_len "
                f"must be <= {window}, got {max_seq_len}")
        shape = (capacity + spare_slots, max_seq_len, self.layout.local_kv_heads,
                 self.config.head_dim)
        layers = range(self.config.num_hidden_layers)
        keys = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers)
        values = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers)
        self.cache = KVCache(keys, values, capacity, max_seq_len)
        return self.cache

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        logit_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(logit_indices), local_width]`` for the selected token rows."""
        return self.project(self.forward_hidden(input_ids, positions, slots, logit_indices))

    __call__ = forward

    def project(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden rows -> this rank's logits shard ``[rows, local_width]``."""
        if not self.batch_invariant:
            return torch.matmul(hidden, self.weights.lm_head.t(), out=out)
        logits = self._linear(hidden, self.weights.lm_head)
        return logits if out is None else out.copy_(logits)

    def _linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        pairs = [(self.weights.lm_head, None)]
        for layer in self.weights.layers:
            pairs += [(layer.qkv, layer.qkv_bias), (layer.o_proj, None),
                      (layer.gate_up, layer.gate_up_bias), (layer.down, None)]
        return pairs

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        row_indices: torch.Tensor,
        host: tuple[list[int], list[int], list[int], list[int]] | None = None,
    ) -> torch.Tensor:
        """Advance the cache by every token; the final-normed hidden state of the selected
        token rows ``[len(row_indices), hidden]`` (what ``project`` turns into logits).
        ``host``: the same (ids, positions, slots, rows) as host lists, checked instead of
        reading the tensors back (the rank step's prepare has them)."""
        if self.cache is None:
            raise RuntimeError("allocate_cache must be called before forward")
        plan = self._plan(input_ids, positions, slots, row_indices, host)
        cfg = self.config
        cos, sin = self._rotary(positions)
        h = self._embed(input_ids)
        for index, layer in enumerate(self.weights.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            h = h + self._attention(x, layer, index, cos, sin, positions, slots, plan)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            h = h + self._mlp(x, layer)
        return rms_norm(h[row_indices], self.weights.final_norm, cfg.rms_norm_eps)

    def _plan(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        logit_indices: torch.Tensor,
        host: tuple[list[int], list[int], list[int], list[int]] | None = None,
    ) -> _AttentionPlan:
        slot_list, pos_list = self._validate(input_ids, positions, slots, logit_indices, host)
        rows_by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slot_list):
            rows_by_slot.setdefault(slot, []).append(row)
        singles = [rows[0] for rows in rows_by_slot.values() if len(rows) == 1]
        chunks = []
        for slot, rows in rows_by_slot.items():
            if len(rows) > 1:
                length = max(pos_list[r] for r in rows) + 1
                index = torch.tensor(rows, dtype=torch.int64, device=self.device)
                chunks.append((index, slot, self._causal_mask(positions[index], length), length))
        if not singles:
            return _AttentionPlan(None, None, None, 0, tuple(chunks))
        single_rows = torch.tensor(singles, dtype=torch.int64, device=self.device)
        single_len = max(pos_list[r] for r in singles) + 1
        mask = self._causal_mask(positions[single_rows], single_len)
        return _AttentionPlan(
            single_rows, slots[single_rows], mask[:, None, None, :], single_len, tuple(chunks)
        )

    def _validate(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        logit_indices: torch.Tensor,
        host: tuple[list[int], list[int], list[int], list[int]] | None = None,
    ) -> tuple[list[int], list[int]]:
        if input_ids.dim() != 1 or logit_indices.dim() != 1:
            raise ValueError("input_ids and logit_indices must be one-dimensional")
        n = input_ids.shape[0]
        for name, t in (("positions", positions), ("slots", slots)):
            if t.shape != (n,):
                raise ValueError(f"{name} must have shape [{n}], got {list(t.shape)}")
        cache = self.cache
        assert cache is not None
        if host is None:
            host = (input_ids.tolist(), positions.tolist(), slots.tolist(),
                    logit_indices.tolist())
        id_list, pos_list, slot_list, row_list = host
        if not n:
            if logit_indices.numel():
                raise ValueError("logit_indices must be empty for an empty batch")
            return slot_list, pos_list
        if not 0 <= min(pos_list) <= max(pos_list) < cache.max_seq_len:
            raise ValueError(f"positions must lie in [0, {cache.max_seq_len})")
        if not 0 <= min(slot_list) <= max(slot_list) < cache.capacity:
            raise ValueError(f"slots must lie in [0, {cache.capacity})")
        if len(set(zip(slot_list, pos_list, strict=True))) != n:
            raise ValueError("two tokens of one batch write the same (slot, position)")
        if not 0 <= min(id_list) <= max(id_list) < self.vocab_size:
            raise ValueError(f"input ids must lie in [0, {self.vocab_size})")
        if row_list and not 0 <= min(row_list) <= max(row_list) < n:
            raise ValueError(f"logit_indices must lie in [0, {n})")
        return slot_list, pos_list

    def _causal_mask(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        keys = torch.arange(length, device=self.device)
        return keys.unsqueeze(0) <= positions.unsqueeze(1)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()
        if self.rotary_scale != 1.0:
            cos, sin = cos * self.rotary_scale, sin * self.rotary_scale
        return cos.to(self.dtype), sin.to(self.dtype)

    def _embed(self, input_ids: torch.Tensor, reduce=None) -> torch.Tensor:
        layout = self.layout
        if layout.tp_size == 1:
            return self.weights.embed[input_ids]
        local = input_ids - layout.vocab_start
        inside = (local >= 0) & (local < layout.local_valid)
        h = self.weights.embed[torch.where(inside, local, 0)]
        h = h * inside.unsqueeze(-1).to(h.dtype)
        return (reduce or self._reduce_group)(h)

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        index: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        plan: _AttentionPlan,
    ) -> torch.Tensor:
        q, k, v = self._qkv(x, layer, cos, sin)
        cache_k, cache_v = self.cache.keys[index], self.cache.values[index]
        cache_k[slots, positions] = k
        cache_v[slots, positions] = v
        groups = self.layout.local_heads // self.layout.local_kv_heads
        if self.batch_invariant:
            out = invariant_attention(q, positions, slots, cache_k, cache_v, groups)
        else:
            out = self._planned_attention(q, cache_k, cache_v, plan, groups)
        return self._attention_output(out, layer, self._reduce_group)

    def _qkv(self, x, layer: LayerWeights, cos, sin):
        """This rank's heads: q ``[n, local_heads, hd]``, k and v ``[n, local_kv_heads, hd]``,
        q and k rotated."""
        layout, hd = self.layout, self.config.head_dim
        qkv = self._linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split((self._q_width, self._kv_width, self._kv_width), dim=-1)
        q = q.view(-1, layout.local_heads, hd)
        k = k.view(-1, layout.local_kv_heads, hd)
        v = v.view(-1, layout.local_kv_heads, hd)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, self.config.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, self.config.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def _attention_output(self, out, layer: LayerWeights, reduce) -> torch.Tensor:
        o = reduce(self._linear(out.view(-1, self._q_width), layer.o_proj))
        return o if layer.o_bias is None else o + layer.o_bias

    def _reduce_group(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, self.group)

    def _reduce_traced(self, tensor: torch.Tensor) -> torch.Tensor:
        """The row-parallel sum as ``helios::all_reduce_sum`` (one traceable node; none at
        TP1)."""
        if self._group_name:
            all_reduce_sum_op(tensor, self._group_name)
        return tensor

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """The compiled forward's function (ranks/step/forward_graph.py): advance the cache by
        every token and return the final-normed hidden state of every token ``[n, hidden]``.
        Each token attends to its own slot's keys at ``key_positions`` (0..L-1, L covering the
        batch's longest context) that are <= its position, so one traced function serves
        decode rows, speculative rounds and prefill chunks alike: no host plan, no shape that
        depends on values. The caller checks the batch (``check_batch``); padding tokens go to
        a spare cache slot at position 0. The sums are custom ops (collectives/ops.py)."""
        cfg = self.config
        groups = self.layout.local_heads // self.layout.local_kv_heads
        cos, sin = self._rotary(positions)
        h = self._embed(input_ids, self._reduce_traced)
        mask = (positions.unsqueeze(1) >= key_positions.unsqueeze(0))[:, None, None, :]
        key_index = (slots.unsqueeze(1), key_positions.unsqueeze(0))
        for index, layer in enumerate(self.weights.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = self._qkv(x, layer, cos, sin)
            cache_k, cache_v = self.cache.keys[index], self.cache.values[index]
            cache_k[slots, positions] = k
            cache_v[slots, positions] = v
            out = self._sdpa(q.unsqueeze(1), cache_k[key_index], cache_v[key_index], mask,
                             groups).squeeze(1)
            h = h + self._attention_output(out, layer, self._reduce_traced)
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            h = h + self._mlp(x, layer, self._reduce_traced)
        return rms_norm(h, self.weights.final_norm, cfg.rms_norm_eps)

    def check_batch(self, input_ids, positions, slots, row_indices, host) -> None:
        """The eager forward's checks of a batch, on prepare's host lists (no tensor read)."""
        if self.cache is None:
            raise RuntimeError("allocate_cache must be called before forward")
        self._validate(input_ids, positions, slots, row_indices, host)

    def _planned_attention(self, q, cache_k, cache_v, plan: _AttentionPlan, groups: int):
        """Decode rows batched (padded to the longest context), one call per prefill chunk."""
        out = torch.empty_like(q)
        if plan.single_rows is not None:
            keys = cache_k[plan.single_slots, : plan.single_len]
            vals = cache_v[plan.single_slots, : plan.single_len]
            out[plan.single_rows] = self._sdpa(
                q[plan.single_rows].unsqueeze(1), keys, vals, plan.single_mask, groups
            ).squeeze(1)
        for rows, slot, mask, length in plan.chunks:
            keys = cache_k[slot, :length].unsqueeze(0)
            vals = cache_v[slot, :length].unsqueeze(0)
            out[rows] = self._sdpa(q[rows].unsqueeze(0), keys, vals, mask, groups).squeeze(0)
        return out

    @staticmethod
    def _sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: int
    ) -> torch.Tensor:
        """q ``[b, nq, heads, hd]``, k/v ``[b, len, kv_heads, hd]`` -> ``[b, nq, heads, hd]``."""
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights, reduce=None) -> torch.Tensor:
        gate, up = self._linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        down = self._linear(F.silu(gate) * up, layer.down)
        down = (reduce or self._reduce_group)(down)
        return down if layer.down_bias is None else down + layer.down_bias
