"""RMSNorm and fused residual add + RMSNorm, one launch each (one program per row).

    rms_norm(x, w, eps)                 -> w · round_x(x / sqrt(mean(x²) + eps))
    add_rms_norm(x, residual, w, eps)   -> (rms_norm(s, w, eps), s)   with s = round_x(x + residual)

Numerics are HF DeepseekV3RMSNorm's (services/models/layers/norm.py): the sum and the normalisation in fp32, the
normalised row rounded to x's dtype, then multiplied by the weight and rounded to the output dtype
(torch's promotion of x's and the weight's dtypes). The residual sum is rounded to x's dtype first, as a
torch `x + residual` in that dtype is. bf16 rounding is explicit bit arithmetic (round to nearest even),
which also keeps the interpreter exact (its own fp32 -> bf16 casts truncate). The mean is a tree sum,
not torch's order, and 1 / sqrt is correctly rounded (sqrt_rn, div_rn): results may differ from torch's
in the last fp32 bit before rounding, so bf16 results agree to one bf16 ulp at most.
References: layer_reference.rms_norm_ref / add_rms_norm_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted
from ddtree.kernels.mla.latent_write import _round_bf16


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, IS_BF16: tl.constexpr):
    """fp32 -> the nearest value of DTYPE, still as fp32."""
    if IS_BF16:
        return _round_bf16(x)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X, RES, W, OUT, RES_OUT,
    n_cols, stride_x, stride_r, stride_o, stride_ro, eps,
    HAS_RESIDUAL: tl.constexpr, X_DTYPE: tl.constexpr, X_BF16: tl.constexpr, OUT_DTYPE: tl.constexpr,
    OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(RES + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        x = _round_to(x + r, X_DTYPE, X_BF16)
        tl.store(RES_OUT + row * stride_ro + offs, x.to(RES_OUT.dtype.element_ty), mask=ok)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 0) / n_cols + eps))
    n = _round_to(x * inv, X_DTYPE, X_BF16)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    y = _round_to(w * n, OUT_DTYPE, OUT_BF16)
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=ok)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_PROMOTED = {(a, b): torch.promote_types(a, b) for a in DTYPES for b in DTYPES}  # at import: no op per call


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    d = weight.shape[0] if weight.dim() == 1 else -1
    if weight.dim() != 1 or x.shape[-1] != d or d < 1:
        raise ValueError(f"x {tuple(x.shape)} must end in the weight's size, weight {tuple(weight.shape)} [d]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must equal x's {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"dtypes {x.dtype} / {weight.dtype} must be in {DTYPES}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    check_device(x.device, is_interpreted(_rms_norm_kernel))
    rows = x.reshape(-1, d)
    if rows.numel() and rows.stride(1) != 1:
        rows = rows.contiguous()
    res = None if residual is None else residual.reshape(-1, d)
    if res is not None and res.numel() and res.stride(1) != 1:
        res = res.contiguous()
    out_dtype = _PROMOTED[x.dtype, weight.dtype]
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(rows) if res is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res if res is not None else rows, weight.contiguous(), out, res_out,
            d, rows.stride(0), (res if res is not None else rows).stride(0), out.stride(0), res_out.stride(0), eps,
            HAS_RESIDUAL=res is not None, X_DTYPE=_TL[x.dtype], X_BF16=x.dtype == torch.bfloat16,
            OUT_DTYPE=_TL[out_dtype], OUT_BF16=out_dtype == torch.bfloat16, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in torch.promote_types(x.dtype, weight.dtype)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., d] (one dtype), weight [d] -> (rms_norm(x + residual), x + residual)."""
    return _launch(x, residual, weight, eps)
