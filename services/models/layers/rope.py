"""Rotary position embedding (default, linear or YaRN frequencies) in the two pair layouts the models use.

Frequencies follow transformers `ROPE_INIT_FUNCTIONS` (YaRN: `_compute_yarn_parameters`, the same math as
DeepSeek `precompute_freqs_cis`): high-frequency pairs keep theta^(-2i/dr), low-frequency pairs are divided
by `factor`, with a linear ramp between the YaRN correction dims; linear scaling divides every frequency by
`factor`.

Frequency i rotates one pair of the dr RoPE dims; which pair is the layout:
- interleaved (the DeepSeek-V3 / Kimi target): adjacent dims (2i, 2i+1) (GPT-J / complex-number convention).
  We rotate the pairs in place, so the target's rotated q_pe / k_pe are in checkpoint order (HF returns them
  de-interleaved; scores are identical).
- rotate-half (the Qwen3-style DFlash drafter): dims (i, i + dr/2) (GPT-NeoX convention).

The m² YaRN magnitude factor belongs in the softmax scale (the target's config.softmax_scale), not here.
The cos/sin `attention_factor` is mscale(f, mscale) / mscale(f, mscale_all_dim), which is 1.0 in every
released target config, but we compute and apply it anyway.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddtree.models.deepseek_v3.config import RopeConfig, yarn_get_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, original_max_pos: int) -> float:
    """Dimension index whose wavelength fits `num_rotations` turns into original_max_pos tokens."""
    return (dim * math.log(original_max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] in fp32 on CPU for rope.rope_type "default", "linear" or "yarn".

    "linear" (position interpolation) divides every default frequency by rope.factor. "yarn" needs
    rope.original_max_position_embeddings; the other two read only rope.theta (and factor).
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim  # [dim/2]
    pos_freqs = rope.theta**exponents
    inv_extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_extrapolation / rope.factor
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
    """cos/sin multiplier (HF `attention_factor`); 1.0 unless YaRN (and then 1.0 when mscale == mscale_all_dim)."""
    if not rope.is_yarn:
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor)


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    *,
    interleaved: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles positions·inv_freq, times attention_factor, for `apply_rope`.

    positions: int [T]; inv_freq: fp32 [dr/2]. The angles, cos and sin are computed in fp32, then cast to
    `dtype`. interleaved=True -> [T, dr/2] (entry i is frequency i); interleaved=False -> [T, dr], the
    angles duplicated ([freqs ; freqs]) before cos/sin, so that dims i and i + dr/2 share frequency i.
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
    if not interleaved:
        angles = torch.cat((angles, angles), dim=-1)  # [T, dr]
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 ; x2] -> [-x2 ; x1] over the last dim (halves of dr/2): the rotate-half layout's partner dims."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the RoPE dims (the last dim, dr wide) of x by the angles whose cos/sin `rope_cos_sin` gave.

    cos/sin must broadcast against x with the last dim dr/2 (interleaved) or dr (rotate-half): the caller
    adds the singleton head dims. The arithmetic runs in cos/sin's dtype (x is cast to it) and the result
    is cast back to x.dtype: the target passes fp32 cos/sin (fp32 math whatever the model dtype), the
    drafter passes them in its model dtype (model-dtype math, as HF Qwen3).
    """
    xc = x.to(cos.dtype)
    if not interleaved:
        return (xc * cos + rotate_half(xc) * sin).to(x.dtype)
    dr = x.shape[-1]
    xf = xc.unflatten(-1, (dr // 2, 2))  # [..., dr/2, 2]
    x_even, x_odd = xf[..., 0], xf[..., 1]
    out = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


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
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)  # fp32 [T, dr/2]
    heads = [1] * (x.dim() - 2)  # broadcast over heads
    return apply_rope(x, cos.view(T, *heads, dr // 2), sin.view(T, *heads, dr // 2), interleaved=True)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies (fp32, non-persistent) and the cos/sin attention factor; interleaved."""

    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        self.dim = dim
        self.attention_factor = rope_attention_factor(rope)
        # explicit device="cpu" so the buffer is real even when the model is built under torch.device("meta")
        self.register_buffer("inv_freq", yarn_inv_freq(rope, dim), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, positions, self.inv_freq, self.attention_factor)


class PositionRope:
    """A RotaryEmbedding at one forward's positions: cos/sin computed once and shared by every layer's
    q_pe and k_pe (the same numbers as calling the RotaryEmbedding each time, fewer ops per layer).
    Called with other positions it computes them afresh."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor):
        self.dim, self.inv_freq, self.attention_factor = rope.dim, rope.inv_freq, rope.attention_factor
        self.positions = positions
        self.cos, self.sin = rope_cos_sin(positions, rope.inv_freq, rope.attention_factor)  # fp32 [T, dr/2]
        self.cis = torch.complex(self.cos, self.sin)  # complex64 [T, dr/2]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions is not self.positions:
            return apply_rope_interleaved(x, positions, self.inv_freq, self.attention_factor)
        T, half = self.cos.shape
        assert x.shape[0] == T and x.shape[-1] == 2 * half, f"x {tuple(x.shape)} vs {T} positions of {2 * half} dims"
        # The pair (2i, 2i+1) times cos_i + i·sin_i as one complex multiply: (a·c - b·s, b·c + a·s), the
        # products and sums apply_rope forms, in fp32 (tests/verifier/test_static_step.py checks the bits).
        pairs = x.to(torch.float32).unflatten(-1, (half, 2))
        try:
            z = torch.view_as_complex(pairs)
        except RuntimeError:  # strides or offset not of whole pairs
            z = torch.view_as_complex(pairs.contiguous())
        out = torch.view_as_real(z * self.cis.view(T, *[1] * (x.dim() - 2), half)).flatten(-2)
        return out.to(x.dtype)
