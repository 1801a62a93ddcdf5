"""Rotary position embeddings: the checkpoint's scaling, read once and turned into frequencies.

Supported ``rope_type`` values are those of Llama-family checkpoints in the wild: ``default``,
``linear`` (position interpolation), ``llama3`` (Llama 3.1 / 3.2) and ``yarn`` (Qwen2.5's
long-context recipe). The frequencies follow transformers' ``modeling_rope_utils`` operation
by operation, so that logits match it; ``dynamic`` NTK (whose frequencies change with the
batch's longest sequence) and ``longrope`` are refused with UnsupportedModelError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from helios_logprobs.ranks.model.errors import ModelConfigError, UnsupportedModelError

DEFAULT_ROPE_THETA = 10000.0
SCALED_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """One checkpoint's RoPE scaling; fields that a type does not use keep their defaults."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SCALED_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {self.rope_type!r}; supported: default, "
                f"{', '.join(SCALED_TYPES)}"
            )
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ModelConfigError(
                f"rope scaling factor must be a positive number, got {self.factor}")
        original = self.original_max_position_embeddings
        if original is not None and original <= 0:
            raise ModelConfigError(
                f"rope scaling original_max_position_embeddings must be positive, got {original}"
            )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ModelConfigError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


def read_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a config.json: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (older files), either possibly nested under ``full_attention``."""
    theta = raw.get("rope_theta")
    scaling = None
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are unsupported")
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise UnsupportedModelError(f"{key} must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):
            if set(params) != {"full_attention"}:
                raise UnsupportedModelError(f"per-layer-type {key} {sorted(params)} unsupported")
            params = params["full_attention"]
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are unsupported")
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
        rope_type = params.get("rope_type", params.get("type"))
        if rope_type not in (None, "default"):
            scaling = _scaling(key, rope_type, params, raw)
    return float(DEFAULT_ROPE_THETA if theta is None else theta), scaling


def _scaling(key: str, rope_type: str, params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    if rope_type not in SCALED_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r} in {key}; supported: default, "
            f"{', '.join(SCALED_TYPES)}"
        )
    fields: dict[str, Any] = {
        name: _number(key, name, params[name])
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor", "mscale", "mscale_all_dim")
        if params.get(name) is not None
    }
    if params.get("truncate") is not None:
        fields["truncate"] = bool(params["truncate"])
    # transformers: the original length defaults to max_position_embeddings (Phi-3 style files
    # keep it at the top level); a yarn factor left out is the ratio of the two lengths.
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or raw.get("max_position_embeddings")
    if original is None and rope_type != "linear":
        raise ModelConfigError(
            f"{key} of type {rope_type!r} needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = raw.get("max_position_embeddings", original) / original
    if factor is None:
        raise ModelConfigError(f"{key} of type {rope_type!r} needs a 'factor'")
    return RopeScaling(
        rope_type=rope_type,
        factor=_number(key, "factor", factor),
        original_max_position_embeddings=None if original is None else int(original),
        **fields,
    )


def _number(key: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"{key}.{name} must be a number, got {value!r}")
    return float(value)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """FP32 ``[head_dim // 2]`` inverse frequencies and the factor that multiplies cos and sin
    (1.0 except for yarn)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(theta, head_dim, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Wavelengths shorter than original/high_freq_factor keep their frequency, those longer
    than original/low_freq_factor are divided by the factor, and the band between blends the
    two linearly in original/wavelength."""
    context = s.original_max_position_embeddings
    low_freq_wavelen = context / s.low_freq_factor
    high_freq_wavelen = context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """NTK-by-parts: dimensions that rotate more than beta_fast times over the original length
    keep their frequency, those under beta_slow are interpolated by the factor, a linear ramp
    between; cos and sin are scaled by the attention factor (0.1 ln(factor) + 1 by default)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
        else:
            attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        original = s.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers: no zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)
