"""Model hyperparameters read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2 and
Qwen3: one decoder recipe, differing in biases, q/k norms and the attention window)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helios_logprobs.ranks.model.errors import ModelConfigError, UnsupportedModelError
from helios_logprobs.ranks.model.rope import RopeScaling, read_rope

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    """Qwen3: an RMSNorm over head_dim on every query and key head, before RoPE."""
    sliding_window: int | None = None
    """Mistral: keys further back than this are not attended. Only served where it never
    binds: max_model_len <= sliding_window (ShardedCausalLM.allocate_cache checks)."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ModelConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window <= 0):
            raise ModelConfigError(f"sliding_window must be a positive integer or null, got "
                             f"{self.sliding_window!r}")
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ModelConfigError(
                    f"special token id {token} outside vocabulary {self.vocab_size}")

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(raw)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        _check_activation(raw)
        _check_no_sliding_window(raw, architecture)
        rope_theta, rope_scaling = read_rope(raw)
        if architecture == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif architecture == "mistral":
            qkv_bias, o_bias, mlp_bias = False, False, False
        elif architecture == "qwen3":
            attention_bias = bool(raw.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, False
        else:
            attention_bias = bool(raw.get("attention_bias", False))
            qkv_bias, o_bias = attention_bias, attention_bias
            mlp_bias = bool(raw.get("mlp_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            rope_scaling=rope_scaling,
            qk_norm=architecture == "qwen3",
            sliding_window=raw.get("sliding_window") if architecture == "mistral" else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The directory's config.json; a missing file, field or malformed value raises
        ModelConfigError naming it (UnsupportedModelError for what this runtime lacks)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in {model_dir}")
        raw = read_json_object(path, ModelConfigError)
        try:
            return cls.from_dict(raw)
        except (UnsupportedModelError, ModelConfigError) as exc:
            raise type(exc)(f"{path}: {exc}") from None
        except KeyError as exc:
            raise ModelConfigError(f"{path}: missing field {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"{path}: {exc}") from None


def read_json_object(path: Path, error: type[ValueError]) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; `error` names the file when it is not one."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise error(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object")
    return raw


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if names:
        raise UnsupportedModelError(
            f"unsupported architectures {names}; supported: {sorted(ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURES.values():
        return str(model_type)
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: "
                                f"{', '.join(sorted(set(ARCHITECTURES.values())))}")


def _check_activation(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")


def _check_no_sliding_window(raw: dict[str, Any], architecture: str) -> None:
    """Qwen's use_sliding_window is refused; Mistral's window is kept in the config (it never
    binds while max_model_len <= sliding_window)."""
    if raw.get("use_sliding_window") and architecture != "mistral":
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is unsupported")
    layer_types = raw.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"unsupported attention layer types {other}")


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
