"""Read one rank's slices of a local Hugging Face safetensors checkpoint (or, behind the same
reader interface, a GGUF file: ranks/model/gguf.py).

Only the rows/columns a rank owns are read (``safe_open(...).get_slice``). Query/key/value and
gate/up are column-parallel (fused into one matrix each), o_proj and down_proj row-parallel, the
embedding and LM head vocabulary-parallel with zero rows for padded lanes; tied checkpoints reuse
the embedding shard as the head.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from helios_logprobs.ranks.model.config import ModelConfig
from helios_logprobs.ranks.model.errors import WeightLoadError
from helios_logprobs.ranks.model.sharding import ShardLayout

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

LoadProgress = Callable[[int, int], None]
"""``progress(done, total)``: ``done`` of ``total`` parts of a shard are loaded."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    """Qwen3's per-head RMSNorm weights ``[head_dim]``, replicated on every rank."""


@dataclass
class ShardWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


class CheckpointReader:
    """Sliced reads from ``model.safetensors`` or the shards named by its index."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                self._files = dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise WeightLoadError(f"unreadable {index}: {exc}") from exc
        elif (self.model_dir / SINGLE_FILE).is_file():
            self._files = {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        else:
            raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.model_dir}")

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, file_name: str) -> Any:
        if file_name not in self._handles:
            path = self.model_dir / file_name
            if not path.is_file():
                raise WeightLoadError(f"checkpoint shard {file_name} missing in {self.model_dir}")
            self._handles[file_name] = self._stack.enter_context(
                safe_open(str(path), framework="pt", device="cpu")
            )
        return self._handles[file_name]

    def has(self, name: str) -> bool:
        return name in self._files

    def read(
        self,
        name: str,
        shape: tuple[int, ...],
        dim: int = 0,
        start: int = 0,
        length: int | None = None,
    ) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, start + length)`` of a tensor."""
        if name not in self._files:
            raise WeightLoadError(
                f"missing tensor {name!r} (expected shape {list(shape)}) in {self.model_dir}"
            )
        handle = self._handle(self._files[name])
        try:
            sliced = handle.get_slice(name)
        except Exception as exc:
            raise WeightLoadError(
                f"missing tensor {name!r} (expected shape {list(shape)}) in {self.model_dir}"
            ) from exc
        actual = tuple(sliced.get_shape())
        if actual != tuple(shape):
            raise WeightLoadError(
                f"tensor {name!r} has shape {list(actual)}, expected shape {list(shape)}"
            )
        if length is None:
            return sliced[:]
        if dim == 0:
            return sliced[start : start + length]
        return sliced[:, start : start + length]


def open_checkpoint(model_dir: str | Path) -> Any:
    """The folder's reader: its GGUF file when a prepared folder links one
    (ranks/model/gguf.py), else its safetensors."""
    from helios_logprobs.ranks.model.gguf import GGUF_FILE, GGUFCheckpointReader

    gguf_path = Path(model_dir) / GGUF_FILE
    if gguf_path.is_file():
        return GGUFCheckpointReader(gguf_path)
    return CheckpointReader(model_dir)


def load_shard_weights(
    model_dir: str | Path,
    config: ModelConfig,
    layout: ShardLayout,
    device: torch.device,
    dtype: torch.dtype,
    progress: LoadProgress | None = None,
    reader: Any | None = None,
) -> ShardWeights:
    """This rank's shard. ``progress(done, total)`` is called after each of ``total`` =
    ``num_hidden_layers + 2`` parts: the embedding (with an untied head), every decoder layer,
    the final norm. ``reader``: where the tensors come from instead of ``model_dir``'s files
    (the same interface as CheckpointReader: weight updates from a trainer)."""

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype).contiguous()

    total = config.num_hidden_layers + 2

    def advance(done: int) -> None:
        if progress is not None:
            progress(done, total)

    with reader if reader is not None else open_checkpoint(model_dir) as reader:
        embed = place(_vocab_rows(reader, "model.embed_tokens.weight", config, layout))
        if config.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = place(_vocab_rows(reader, "lm_head.weight", config, layout))
        advance(1)
        layers = []
        for i in range(config.num_hidden_layers):
            layers.append(_load_layer(reader, f"model.layers.{i}.", config, layout, place))
            advance(i + 2)
        final_norm = place(reader.read("model.norm.weight", (config.hidden_size,)))
        advance(total)
    return ShardWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def _vocab_rows(
    reader: Any, name: str, config: ModelConfig, layout: ShardLayout
) -> torch.Tensor:
    rows = reader.read(
        name,
        (config.vocab_size, config.hidden_size),
        dim=0,
        start=layout.vocab_start,
        length=layout.local_valid,
    )
    out = torch.zeros(layout.local_width, config.hidden_size, dtype=rows.dtype)
    out[: layout.local_valid] = rows
    return out


def _load_layer(
    reader: Any,
    prefix: str,
    config: ModelConfig,
    layout: ShardLayout,
    place: Any,
) -> LayerWeights:
    hidden, hd = config.hidden_size, config.head_dim
    q_rows = (layout.head_start * hd, layout.local_heads * hd)
    kv_rows = (layout.kv_head_start * hd, layout.local_kv_heads * hd)
    inter = (layout.intermediate_start, layout.local_intermediate)
    q_full = config.num_attention_heads * hd
    kv_full = config.num_key_value_heads * hd
    attn, mlp = prefix + "self_attn.", prefix + "mlp."

    def rows(name: str, full: tuple[int, ...], span: tuple[int, int]) -> torch.Tensor:
        return reader.read(name, full, dim=0, start=span[0], length=span[1])

    def cols(name: str, full: tuple[int, ...], span: tuple[int, int]) -> torch.Tensor:
        return reader.read(name, full, dim=1, start=span[0], length=span[1])

    qkv = torch.cat(
        [
            rows(attn + "q_proj.weight", (q_full, hidden), q_rows),
            rows(attn + "k_proj.weight", (kv_full, hidden), kv_rows),
            rows(attn + "v_proj.weight", (kv_full, hidden), kv_rows),
        ]
    )
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = torch.cat(
            [
                rows(attn + "q_proj.bias", (q_full,), q_rows),
                rows(attn + "k_proj.bias", (kv_full,), kv_rows),
                rows(attn + "v_proj.bias", (kv_full,), kv_rows),
            ]
        )
    gate_up = torch.cat(
        [
            rows(mlp + "gate_proj.weight", (config.intermediate_size, hidden), inter),
            rows(mlp + "up_proj.weight", (config.intermediate_size, hidden), inter),
        ]
    )
    gate_up_bias = o_bias = down_bias = None
    if config.mlp_bias:
        gate_up_bias = place(
            torch.cat(
                [
                    rows(mlp + "gate_proj.bias", (config.intermediate_size,), inter),
                    rows(mlp + "up_proj.bias", (config.intermediate_size,), inter),
                ]
            )
        )
        down_bias = place(reader.read(mlp + "down_proj.bias", (hidden,)))
    if config.o_bias:
        o_bias = place(reader.read(attn + "o_proj.bias", (hidden,)))
    return LayerWeights(
        input_norm=place(reader.read(prefix + "input_layernorm.weight", (hidden,))),
        qkv=place(qkv),
        qkv_bias=None if qkv_bias is None else place(qkv_bias),
        o_proj=place(cols(attn + "o_proj.weight", (hidden, q_full), q_rows)),
        o_bias=o_bias,
        post_norm=place(reader.read(prefix + "post_attention_layernorm.weight", (hidden,))),
        gate_up=place(gate_up),
        gate_up_bias=gate_up_bias,
        down=place(cols(mlp + "down_proj.weight", (hidden, config.intermediate_size), inter)),
        down_bias=down_bias,
        q_norm=place(reader.read(attn + "q_norm.weight", (hd,))) if config.qk_norm else None,
        k_norm=place(reader.read(attn + "k_norm.weight", (hd,))) if config.qk_norm else None,
    )
