"""YaRN rotary position embedding with interleaved pairs (model.md §2).

Frequencies follow transformers `_compute_yarn_parameters` (same math as DeepSeek `precompute_freqs_cis`):
high-frequency pairs keep theta^(-2i/dr), low-frequency pairs are divided by `factor`, with a linear ramp
between the YaRN correction dims. The checkpoint lays the dr RoPE dims out as adjacent pairs
(2i, 2i+1) rotated by frequency i (GPT-J / complex-number convention); we rotate the pairs in place, so
our rotated q_pe / k_pe are in checkpoint order (HF returns them de-interleaved; scores are identical).

The m² YaRN magnitude factor belongs in the softmax scale (config.softmax_scale), not here. The cos/sin
`attention_factor` is mscale(f, mscale) / mscale(f, mscale_all_dim), which is 1.0 in every released
config, but we compute and apply it anyway.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import RopeConfig, yarn_get_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, original_max_pos: int) -> float:
    """Dimension index whose wavelength fits `num_rotations` turns into original_max_pos tokens."""
    return (dim * math.log(original_max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] in fp32 on CPU (default RoPE when rope.rope_type == "default")."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim  # [dim/2]
    pos_freqs = rope.theta**exponents
    inv_extrapolation = 1.0 / pos_freqs
    if not rope.is_yarn:
        return inv_extrapolation
    inv_interpolation = 1.0 / (rope.factor * pos_freqs)
    orig = rope.original_max_position_embeddings
    low = _correction_dim(rope.beta_fast, dim, rope.theta, orig)
    high = _correction_dim(rope.beta_slow, dim, rope.theta, orig)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 for high-frequency pairs (small i): keep the original frequency
    return inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight


def rope_attention_factor(rope: RopeConfig) -> float:
    """cos/sin multiplier (HF `attention_factor`); 1.0 for default RoPE and when mscale == mscale_all_dim."""
    if not rope.is_yarn:
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor)


def apply_rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of x by angle positions·inv_freq[i].

    x: [T, ..., dr] (e.g. q_pe [T, H, dr] or k_pe [T, dr]); positions: int [T]; inv_freq: fp32 [dr/2].
    Computed in fp32, returned in x.dtype.
    """
    T, dr = x.shape[0], x.shape[-1]
    assert positions.shape == (T,), f"positions {tuple(positions.shape)} != ({T},)"
    assert inv_freq.shape == (dr // 2,), f"inv_freq {tuple(inv_freq.shape)} != ({dr // 2},)"
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)  # [T, dr/2]
    angles = angles.view(T, *([1] * (x.dim() - 2)), dr // 2)  # broadcast over heads
    cos = angles.cos() * attention_factor
    sin = angles.sin() * attention_factor
    xf = x.to(torch.float32).unflatten(-1, (dr // 2, 2))  # [..., dr/2, 2]
    x_even, x_odd = xf[..., 0], xf[..., 1]
    out = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Holds the YaRN inverse frequencies (fp32, non-persistent) and the cos/sin attention factor."""

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.dim = dim
        self.attention_factor = rope_attention_factor(rope)
        # explicit device="cpu" so the buffer is real even when the model is built under torch.device("meta")
        self.register_buffer("inv_freq", yarn_inv_freq(rope, dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, positions, self.inv_freq, self.attention_factor)
