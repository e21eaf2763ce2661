"""Rotary embedding of the queries' rope part, one launch: q_pe [T, H, dr] (a strided view of q) rotated by
the forward's cos / sin (models/layers/rope.py PositionRope: fp32 [T, dr/2], computed once per forward).

Interleaved pairs, as DeepSeek / Kimi checkpoints store them: dims (2i, 2i + 1) of every head rotate by
frequency i, (a, b) -> (a·c - b·s, b·c + a·s), in fp32 from the input dtype, rounded to it once (bf16
rounding as explicit bit arithmetic, which keeps the interpreter exact). The torch path
(PositionRope.__call__, the reference) forms the same products and sums as one complex multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted
from ddtree.kernels.rmsnorm import _TL, _round_to


@triton.jit
def _rope_kernel(
    X, COS, SIN, OUT, stride_xt, stride_xh, stride_ct, stride_st,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    DTYPE: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)
    ok = (h < HEADS)[:, None] & (p < HALF)[None, :]
    at = X + t * stride_xt + h[:, None] * stride_xh + 2 * p[None, :]
    a = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(COS + t * stride_ct + p, mask=p < HALF, other=0.0)[None, :]
    s = tl.load(SIN + t * stride_st + p, mask=p < HALF, other=0.0)[None, :]
    out = OUT + t * (HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + 2 * p[None, :]
    tl.store(out, _round_to(a * c - b * s, DTYPE, IS_BF16).to(OUT.dtype.element_ty), mask=ok)
    tl.store(out + 1, _round_to(b * c + a * s, DTYPE, IS_BF16).to(OUT.dtype.element_ty), mask=ok)


def rope_q(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, dr] (unit last stride), cos / sin fp32 [T, dr/2] -> rotated x, contiguous [T, H, dr]."""
    if x.dim() != 3 or x.shape[-1] % 2 or cos.shape != (x.shape[0], x.shape[-1] // 2) or sin.shape != cos.shape:
        raise ValueError(f"x {tuple(x.shape)} must be [T, H, dr] with cos / sin [T, dr/2], got {tuple(cos.shape)}")
    if x.dtype not in DTYPES or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"x must be one of {DTYPES} and cos / sin fp32, got {x.dtype} / {cos.dtype}")
    check_device(x.device, is_interpreted(_rope_kernel))
    if x.numel() and x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = (c if c.numel() == 0 or c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
    T, H, dr = x.shape
    out = torch.empty(T, H, dr, dtype=x.dtype, device=x.device)
    if out.numel():
        _rope_kernel[(T,)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEADS=H, HALF=dr // 2, BLOCK_H=triton.next_power_of_2(H), BLOCK_P=triton.next_power_of_2(dr // 2),
            DTYPE=_TL[x.dtype], IS_BF16=x.dtype == torch.bfloat16, num_warps=2,
        )  # fmt: skip
    return out
