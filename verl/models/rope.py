"""RoPE inverse frequencies for every engine, plain and scaled, computed in one place.

The HF config's RoPE settings are read by the model specs (``verl.models.spec.base.read_rope``) into a
:class:`RopeScaling`; the native rollout engine and the Megatron builder both take their frequencies (and
YaRN's attention scaling of cos/sin) from :func:`inv_freq`, which follows transformers'
``ROPE_INIT_FUNCTIONS`` operation for operation (the unit tests compare them bit for bit). FSDP runs
transformers' own module and SGLang reads the HF config itself.

  linear  positions interpolated: every frequency divided by ``factor``
  llama3  low frequencies (wavelength > original context / low_freq_factor) divided by ``factor``, high ones
          (wavelength < original context / high_freq_factor) kept, a smooth blend between
  yarn    per-dimension blend of interpolated (/ factor) and extrapolated frequencies over the correction range
          [beta_fast, beta_slow] rotations within the original context; cos and sin scaled by the attention
          factor (``0.1 ln(factor) + 1`` unless the config names it or gives mscale / mscale_all_dim)
"""

from __future__ import annotations

import dataclasses
import math

import torch

SCALED_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE (plain RoPE is ``ModelConfig.rope = None``); fields a type does not use keep defaults."""

    rope_type: str                              # one of SCALED_TYPES
    factor: float
    original_max_position_embeddings: int = 0   # llama3, yarn: the pre-training context
    low_freq_factor: float = 1.0                # llama3
    high_freq_factor: float = 4.0               # llama3
    beta_fast: float = 32.0                     # yarn
    beta_slow: float = 1.0                      # yarn
    truncate: bool = True                       # yarn: round the correction range outward to whole dims
    attention_factor: float = 1.0               # yarn: cos and sin multiplied by it (resolved at read)

    def __post_init__(self):
        if self.rope_type not in SCALED_TYPES:
            raise ValueError(f"rope type: expected one of {SCALED_TYPES}, found {self.rope_type!r}")


def yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """YaRN's default attention factor (transformers' rule: DeepSeek's mscale ratio when both are given)."""
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [head_dim // 2], the factor cos and sin are multiplied by)."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    if scaling is None or scaling.rope_type in ("linear", "llama3"):
        base = 1.0 / (theta ** exponents)
        if scaling is None:
            return base, 1.0
        if scaling.rope_type == "linear":
            return base / scaling.factor, 1.0
        return _llama3(base, scaling), 1.0
    return _yarn(dim, theta, exponents, scaling), scaling.attention_factor


def _llama3(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, exponents: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** exponents
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=exponents.device, dtype=torch.float)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
