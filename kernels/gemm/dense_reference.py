"""Torch references of the dense quantized GEMMs (gemm/fp8.py, gemm/int4.py): test oracles in fp32 math on
weights dequantized with quant_formats.py. Each mirrors one kernel wrapper's arguments.

The FP8 references quantize the activations exactly as the kernel does inside its K loop
(`per_token_group_quant_fp8_reference` is the torch twin of that quantization: same amax floor, IEEE division,
clamp and round-to-nearest-even cast), so `fp8_block_gemm` and `fp8_block_gemm_reference` differ only by the
GEMM's summation order. `fp8_block_linear_reference` is what an unquantized-activation model computes
(x · dequantized Wᵀ), to bound the activation quantization error.
"""

from __future__ import annotations

import torch

from ddtree.kernels.quant_formats import FP8_MAX, dequantize_fp8_block, dequantize_int4

FP8_EPS = 1e-10  # gemm.fp8.FP8_EPS


def per_token_group_quant_fp8_reference(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/group)]): s = max(amax, 1e-10) / 448,
    q = e4m3(clamp(x / s, ±448)) per group of `group_size` columns (the last group may be shorter)."""
    M, K = x.shape
    groups = -(-K // group_size)
    xf = torch.zeros(M, groups * group_size, dtype=torch.float32, device=x.device)
    xf[:, :K] = x.float()
    g = xf.view(M, groups, group_size)
    scale = g.abs().amax(dim=2).clamp(min=FP8_EPS) / FP8_MAX  # [M, groups]
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(M, -1)[:, :K]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_activations_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q [M, K], scale [M, ceil(K/g)]) -> fp32 [M, K] = q · scale[:, k // g]."""
    return q.float() * scale.float().repeat_interleave(group_size, dim=1)[:, : q.shape[1]]


def w8a8_block_fp8_matmul_reference(
    q: torch.Tensor,  # float8_e4m3fn [M, K]
    q_scale: torch.Tensor,  # fp32 [M, ceil(K/bk)]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [M, N] out_dtype
    a = dequantize_activations_fp8(q.cpu(), q_scale.cpu(), block_size[1])
    w = dequantize_fp8_block(weight.cpu(), weight_scale_inv.cpu(), tuple(block_size))
    return (a @ w.T).to(out_dtype).to(q.device)


def fp8_block_gemm_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:  # [M, N], dtype of x
    """What fp8_block_gemm computes: the activations quantized per token group of bk, then the GEMM."""
    q, s = per_token_group_quant_fp8_reference(x, block_size[1])
    return w8a8_block_fp8_matmul_reference(q, s, weight, weight_scale_inv, block_size, x.dtype)


def fp8_block_linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:  # [M, N], dtype of x
    """x · Wᵀ with W dequantized and x unquantized (fp32): the linear the FP8 checkpoint stands for."""
    w = dequantize_fp8_block(weight.cpu(), weight_scale_inv.cpu(), tuple(block_size))
    return (x.float().cpu() @ w.T).to(x.dtype).to(x.device)


def int4_gemm_reference(
    x: torch.Tensor,  # [M, K]
    weight_packed: torch.Tensor,  # int32 [N, ceil(K/8)]
    weight_scale: torch.Tensor,  # [N, ceil(K/g)]
    group_size: int,
    in_features: int | None = None,
) -> torch.Tensor:  # [M, N], dtype of x
    K = x.shape[1] if in_features is None else in_features
    w = dequantize_int4(weight_packed.cpu(), weight_scale.cpu(), group_size, K)  # fp32 [N, K]
    return (x.float().cpu() @ w.T).to(x.dtype).to(x.device)
