"""Rotary position embeddings (rotate-half / NeoX layout) with default, llama3 and YaRN scaling.

The inverse frequencies follow transformers' `modeling_rope_utils` (`_compute_yarn_parameters`,
`_compute_llama3_parameters`) so our target reproduces HF logits. YaRN is also an inference-time
option for inputs past the training length (DESIGN.md §5): `with_yarn(cfg, factor, original_max)`.

`rope_scaling` is a dict with a `rope_type` key (old configs spell it `type`):
  {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": m,
   "beta_fast": 32, "beta_slow": 1, "attention_factor": None, "mscale": ..., "mscale_all_dim": ...,
   "truncate": True}
  {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
   "original_max_position_embeddings": 8192}
  {"rope_type": "linear", "factor": f}
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

__all__ = ["rope_parameters", "RotaryEmbedding", "apply_rotary", "rotate_half", "with_yarn", "yarn_scaling"]


def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _yarn(dim: int, base: float, sc: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = sc.get("factor")
    orig = sc.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = sc.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = sc.get("mscale"), sc.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = sc.get("beta_fast") or 32
    beta_slow = sc.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _llama3(dim: int, base: float, sc: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(dim, base)
    factor, low_ff, high_ff = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_ctx = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_parameters(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim/2] float32, attention_scaling applied to cos/sin)."""
    sc = dict(rope_scaling or {})
    kind = sc.get("rope_type", sc.get("type", "default")) or "default"
    if kind == "default":
        return _default_inv_freq(head_dim, rope_theta), 1.0
    if kind == "linear":
        return _default_inv_freq(head_dim, rope_theta) / sc["factor"], 1.0
    if kind == "yarn":
        return _yarn(head_dim, rope_theta, sc, max_position_embeddings)
    if kind == "llama3":
        return _llama3(head_dim, rope_theta, sc), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, yarn, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions; computed per call (positions are ragged per row)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int = 2048):
        super().__init__()
        self.head_dim = head_dim
        self.configure(rope_theta, rope_scaling, max_position_embeddings)

    def configure(self, rope_theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int,
                  device: torch.device | str | None = None) -> None:
        """(Re)build the inverse frequencies, e.g. to switch YaRN on at inference."""
        with torch.device("cpu"):  # real values even when the model is built on the meta device
            inv_freq, self.attention_scaling = rope_parameters(
                self.head_dim, rope_theta, rope_scaling, max_position_embeddings)
        if device is None and "inv_freq" in self._buffers:
            device = self.inv_freq.device
        self.register_buffer("inv_freq", inv_freq.to(device or "cpu"), persistent=False)  # [D/2] fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] long -> cos, sin [N, T, D] in `dtype` (computed in float32 like HF)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [N, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                       # [N, T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, h, D], cos/sin [N, T, D] -> [N, T, h, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [N, T, 1, D]
    return x * cos + rotate_half(x) * sin


def yarn_scaling(factor: float, original_max: int, beta_fast: float = 32, beta_slow: float = 1) -> dict[str, Any]:
    """The rope_scaling dict for YaRN with transformers' semantics."""
    if factor <= 1:
        raise ValueError(f"YaRN factor must be > 1, got {factor}")
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original_max),
            "beta_fast": beta_fast, "beta_slow": beta_slow}


def with_yarn(cfg: Any, factor: float, original_max: int | None = None) -> Any:
    """Copy of a config dataclass (TargetConfig, DrafterConfig, ...) with YaRN enabled (or overridden).

    original_max defaults to the config's max_position_embeddings (the training length); the copy's
    max_position_embeddings becomes original_max * factor.
    """
    orig = int(original_max or cfg.max_position_embeddings)
    return dataclasses.replace(cfg, rope_scaling=yarn_scaling(factor, orig),
                               max_position_embeddings=int(orig * factor))
