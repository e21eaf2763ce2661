"""Dense GEMM with one tile shape per weight shape: y = x · Wᵀ (+ b) for the model's unquantized linears on the
device path (bf16 / fp16 / fp32), in place of cuBLAS.

Row invariance (docs/design.md): cuBLAS picks its kernel, tile and split-K from M, so a row's sum order
follows how many rows share the launch (a 17-row verify tree against AR's one row). Here every launch uses
BLOCK_M = 64, BLOCK_N by N, BLOCK_K = 64, one K loop from k = 0 upwards with fp32 accumulation, no split-K,
no atomics: row m's result is a function of x[m] and W alone. Its cost at small M (a 64-row tile for one
row, the weight read once per column tile as before) is counted in docs/performance.md.

Interpreter (triton 3.9): its bf16 dot multiplies raw bits and its fp32 -> bf16 cast truncates, so interpreted
bf16 runs the dot in fp32 (exact products of bf16 values) and rounds the output to bf16 explicitly
(latent_write._round_bf16), as the INT4 GEMM does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .latent_write import _round_bf16
from .mla_checks import DTYPES, check_device, is_interpreted
from .shared_memory import device_smem_budget, dot_smem_bytes, stages_within

BLOCK_M = 64  # rows per tile at every M
BLOCK_K = 64


@triton.jit
def _dense_gemm_kernel(
    X, W, B, Y, M, N, K,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_yb, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VIA_FP32: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Y[b, m-tile, n-tile] = Σ_k-tiles X[b] · W[b]ᵀ (+ B), k-tiles in order from 0."""
    b = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + b * stride_xb + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + b * stride_wb + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if VIA_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(Y + b * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def smem_bytes(block_n: int, x_bytes: int, num_stages: int) -> int:
    """shared_memory's estimate: the x and weight tiles per buffer."""
    return dot_smem_bytes(num_stages, BLOCK_M, [(BLOCK_M, BLOCK_K, x_bytes), (BLOCK_K, block_n, x_bytes)], [])


def _launch(x, weight, bias, out) -> None:
    """x [Bt, M, K], weight [Bt, N, K], out [Bt, M, N] (views, any strides but out's last = 1)."""
    Bt, M, K = x.shape
    N = weight.shape[1]
    if M == 0 or N == 0 or Bt == 0:
        return
    interpreted = is_interpreted(_dense_gemm_kernel)
    check_device(x.device, interpreted)
    block_n = 64 if N <= 64 else 128
    stages = stages_within(device_smem_budget(x.device), lambda s: smem_bytes(block_n, x.element_size(), s))
    via_fp32 = interpreted and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or via_fp32 else "tf32"
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n), Bt)
    _dense_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        *x.stride(), *weight.stride(), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision, VIA_FP32=via_fp32, ROUND_BF16=via_fp32, num_stages=stages,
    )  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor, K: int, what: str) -> None:
    if x.shape[-1] != K or x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"{what}: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)} "
                         "must share K and a dtype of bf16 / fp16 / fp32")  # fmt: skip


def dense_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias [N]) -> [..., N] in x's dtype (weight and bias in x's dtype)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("dense_gemm: x [..., K] and weight [N, K] must be tensors")
    N, K = weight.shape
    _check(x, weight, K, "dense_gemm")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"dense_gemm: bias must be {x.dtype} [{N}], got {bias.dtype} {tuple(bias.shape)}")
    x2 = x.reshape(-1, K)
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    _launch(x2[None], weight[None], bias, out[None])
    return out.view(*x.shape[:-1], N)


def head_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per head h: x [T, H, K] (any strides) · weight[h] [N, K]ᵀ -> [T, H, N] in x's dtype; weight [H, N, K] any
    strides (MLA's absorptions: W_UK as [H, r, dn] = w_uk.transpose(1, 2), W_UV [H, dv, r])."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"head_gemm: x [T, H, K] {tuple(x.shape)} and weight [H, N, K] {tuple(weight.shape)}")
    T, H, K = x.shape
    _check(x, weight, K, "head_gemm")
    out = torch.empty(T, H, weight.shape[1], dtype=x.dtype, device=x.device)
    _launch(x.transpose(0, 1), weight, None, out.transpose(0, 1))
    return out


__all__ = ["dense_gemm", "head_gemm"]
