"""Read one rank's slices of a GGUF checkpoint (llama.cpp's format) behind CheckpointReader's
interface, and its metadata as a Hugging Face ``config.json``.

Tensors are renamed to Hugging Face's names, dequantized with the ``gguf`` package (llama.cpp's
own reader: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...) to float32, and llama.cpp's
query/key row permutation (its converter interleaves each head's rotary halves for Llama and
Mistral) is undone. Quantization blocks run along rows, so a row slice reads only its rows; a
column slice reads only its blocks when it starts and ends on a block boundary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from helios_logprobs.ranks.model.errors import (
    ModelConfigError,
    UnsupportedModelError,
    WeightLoadError,
)

GGUF_FILE = "model.gguf"
"""The name under which a prepared folder links its GGUF file (launch/gguf_folder.py)."""

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_ARCHITECTURES = ("llama", "mistral")
"""llama.cpp's converter permutes attn_q/attn_k rows for these (LlamaModel.permute)."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` (memory-mapped); an unreadable file raises ModelConfigError."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelConfigError(f"{path}: not a readable GGUF file ({exc})") from None


def metadata_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class GGUFCheckpointReader:
    """CheckpointReader's interface (``has``, ``read``, a context manager) over a GGUF file."""

    def __init__(self, path: str | Path, reader: Any | None = None) -> None:

        self.path = Path(path)
        self._error = WeightLoadError
        self._reader = reader if reader is not None else open_gguf(self.path)
        self.architecture = str(metadata_value(self._reader, "general.architecture", ""))
        self._tensors = {}
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
        prefix = self.architecture
        self._heads = int(metadata_value(self._reader, f"{prefix}.attention.head_count", 0) or 0)
        self._permuted = self.architecture in PERMUTED_ARCHITECTURES

    def __enter__(self) -> GGUFCheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader = None
        self._tensors = {}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def read(
        self,
        name: str,
        shape: tuple[int, ...],
        dim: int = 0,
        start: int = 0,
        length: int | None = None,
    ) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, start + length)`` of a tensor,
        dequantized to float32, in Hugging Face's layout."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise self._error(
                f"missing tensor {name!r} (expected shape {list(shape)}) in {self.path}")
        actual = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if actual != tuple(shape):
            raise self._error(f"tensor {name!r} has shape {list(actual)}, expected shape "
                              f"{list(shape)} ({self.path})")
        if length is None:
            start, length = 0, shape[dim]
        values = self._dequantized(tensor, shape, dim, start, length)
        if self._permuted and dim == 0 and (".q_proj." in name or ".k_proj." in name):
            values = _unpermute_rows(values, head_dim=self._head_dim(name, shape))
        return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))

    def _head_dim(self, name: str, shape: tuple[int, ...]) -> int:
        # q_proj has head_count heads of head_dim rows; k_proj has head_count_kv of the same
        q_rows = self._tensors[name.replace(".k_proj.", ".q_proj.")].shape.tolist()
        rows = int(q_rows[-1]) if len(q_rows) > 1 else int(q_rows[0])
        if not self._heads or rows % self._heads:
            raise self._error(f"{self.path}: attention.head_count {self._heads} does not divide "
                              f"the query rows {rows}")
        return rows // self._heads

    def _dequantized(self, tensor: Any, shape: tuple[int, ...], dim: int, start: int,
                     length: int) -> np.ndarray:
        import gguf

        qtype = tensor.tensor_type
        data = tensor.data
        if len(shape) == 1:
            return self._convert(data[start:start + length], qtype)
        if dim == 0:
            return self._convert(data[start:start + length], qtype).reshape(length, shape[1])
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return self._convert(data[:, start:start + length], qtype)
        if start % block == 0 and length % block == 0:
            lo, hi = start // block * block_bytes, (start + length) // block * block_bytes
            return self._convert(np.ascontiguousarray(data[:, lo:hi]), qtype)
        return self._convert(data, qtype).reshape(shape)[:, start:start + length]

    def _convert(self, data: np.ndarray, qtype: Any) -> np.ndarray:
        import gguf

        try:
            return gguf.quants.dequantize(np.asarray(data), qtype)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: GGUF tensor type {qtype.name} cannot be dequantized") from None


def _unpermute_rows(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: within each head its rows were reordered from
    ``[half, head_dim/2]`` to ``[head_dim/2, half]`` (transformers' reverse_permute_weights).
    ``rows`` covers whole heads, so a rank's slice unpermutes on its own."""
    heads = rows.shape[0] // head_dim
    shaped = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return shaped.swapaxes(1, 2).reshape(rows.shape)


def hf_config(reader: Any) -> dict[str, Any]:
    """The Hugging Face ``config.json`` a GGUF file's metadata describes (what transformers'
    GGUF loading derives: ggml.py's GGUF_CONFIG_MAPPING)."""
    arch = str(metadata_value(reader, "general.architecture", ""))
    name = str(metadata_value(reader, "general.name", "") or "")
    if arch == "llama" and "mistral" in name.lower():
        arch = "mistral"  # llama.cpp writes Mistral models as llama (transformers does this)
    prefix = str(metadata_value(reader, "general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: "
                                    f"{', '.join(sorted(ARCHITECTURES))}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("GGUF rope_freqs (Llama 3.1 frequency factors) are unsupported")

    def key(suffix: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{prefix}.{suffix}", default)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    heads = key("attention.head_count")
    if heads is None or key("embedding_length") is None or vocab is None:
        raise ModelConfigError("GGUF metadata lacks attention.head_count, embedding_length "
                               "or a vocabulary")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": int(key("block_count", 0)),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": _float_dtype(reader),
    }
    head_dim = key("attention.key_length") or key("rope.dimension_count")
    if head_dim:
        config["head_dim"] = int(head_dim)
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "mistral" and key("attention.sliding_window"):
        config["sliding_window"] = int(key("attention.sliding_window"))
    scaling = _rope_scaling(key)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for field, target in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = metadata_value(reader, f"tokenizer.ggml.{field}")
        if value is not None:
            config[target] = int(value)
    return config


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(key("rope.scaling.factor",
                                                                            1.0))}
    original = key("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _float_dtype(reader: Any) -> str:
    """The checkpoint's dtype for ``--dtype auto`` on CUDA: its 2-D tensors' float type, and
    bfloat16 for quantized ones (their scales need float16's range at most, bf16 its speed)."""
    import gguf

    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if kinds == {gguf.GGMLQuantizationType.F32}:
        return "float32"
    if kinds == {gguf.GGMLQuantizationType.F16}:
        return "float16"
    return "bfloat16"
