"""INT4 dense GEMM (W4A16, compressed-tensors pack-quantized, symmetric, group-wise): y = x · Wᵀ with

    weight_packed int32 [N, ceil(K/8)]: nibble j of word w (bits 4j..4j+3) holds column 8w + j as v + 8
    weight_scale        [N, ceil(K/g)] (bf16 / fp16 / fp32): W[n, k] = (nibble - 8) · scale[n, k // g]

for the linears a Kimi-style checkpoint quantizes outside the experts (quant_formats.py has the arithmetic).

One program per [BLOCK_M, BLOCK_N] output tile. The K loop loads the int32 word of every (k, n) of the
[BLOCK_K, BLOCK_N] Wᵀ tile (word k // 8, so each word serves 8 consecutive k), shifts its nibble down
((k % 8) · 4), masks it and subtracts 8, then
- when BLOCK_K divides the group (g = 32 / 64 / 128, and per-channel scales): one scale per column and K
  step, applied after the dot, acc += dot(x, q) · s[None, :]. The nibbles are small integers, exact in
  bf16 / fp16, so the products are exact and only the fp32 sums round;
- otherwise (groups that are not a multiple of 16): each element is dequantized, q · s in fp32, then cast
  to x's dtype for the dot.
Accumulation is fp32; the result is stored in x's dtype. Ragged M, N, K are masked (columns past K load
x = 0, which cancels whatever the padding nibbles hold).

Interpreter (triton 3.9): its bf16 dot multiplies the raw bits and its fp32 -> bf16 cast truncates, so
interpreted bf16 runs dot in fp32 (exact here: bf16 and the nibbles are exact in fp32) and round the
output to bf16 explicitly (see latent_write._round_bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, check_matrix, is_interpreted
from ddtree.kernels.mla.latent_write import _round_bf16
from ddtree.kernels.quant_formats import PACK
from ddtree.kernels.shared_memory import device_smem_budget, dot_smem_bytes, stages_within


@triton.jit
def _int4_gemm_kernel(
    X, W, S, Y, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_AFTER_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, VIA_FP32: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    shifts = ((offs_k % 8) * 4)[:, None]  # [BLOCK_K, 1]: the nibble of column k in its word
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + offs_n[None, :] * stride_wn + (offs_k // 8)[:, None]  # [BLOCK_K, BLOCK_N] words (BLOCK_K % 8 == 0)
    s_row = S + offs_n * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        words = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = ((words >> shifts) & 0xF) - 8  # int32 [BLOCK_K, BLOCK_N] in [-8, 7]
        if VIA_FP32:
            x = x.to(tl.float32)
        if SCALE_AFTER_DOT:
            s = tl.load(s_row + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            acc += tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION) * s[None, :]
        else:
            s = tl.load(s_row[None, :] + ((k0 + offs_k) // GROUP)[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            acc = tl.dot(x, (q.to(tl.float32) * s).to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
    if ROUND_BF16:
        acc = _round_bf16(acc)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


ROW_BLOCK_M = 64  # rows per tile at every M (row invariance; docs/performance.md counts the cost at small M)


def _tiles(M: int, N: int, group: int, per_channel: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, scale after the dot). Row invariant: one tile shape per weight shape, never
    from M (a row's sum runs the same K order in the same instruction shape whatever rows share the launch)."""
    block_m = ROW_BLOCK_M
    block_n = 64 if N <= 64 else 128
    if per_channel:  # one group spans K: every k // group is 0
        return block_m, block_n, 128, True
    pow2 = group & -group  # the largest power of two dividing the group
    if pow2 >= 16:
        return block_m, block_n, min(128, pow2), True
    return block_m, block_n, 64, False


def smem_bytes(block_m: int, block_n: int, block_k: int, x_bytes: int, num_stages: int) -> int:
    """shared_memory's estimate: the x tile and the weight words per buffer (loaded [BLOCK_K, BLOCK_N], a word
    per element: w_ptrs), the weight dequantized to x's width."""
    return dot_smem_bytes(num_stages, block_m, [(block_m, block_k, x_bytes), (block_k, block_n, 4)],
                          [(block_k, block_n, x_bytes)])  # fmt: skip


def launch_tiles(M: int, N: int, group: int, per_channel: bool, x_bytes: int, budget: int | None):
    """(BLOCK_M, BLOCK_N, BLOCK_K, scale after the dot, num_stages) within `budget` bytes of shared memory
    (None: no limit): _tiles', block_n halved while one stage does not fit (wide fp32 tiles on sm_120)."""
    bm, bn, bk, after = _tiles(M, N, group, per_channel)
    while budget is not None and bn > 16 and smem_bytes(bm, bn, bk, x_bytes, 1) > budget:
        bn //= 2
    return bm, bn, bk, after, stages_within(budget, lambda s: smem_bytes(bm, bn, bk, x_bytes, s))


def int4_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    weight_packed: torch.Tensor,  # int32 [N, ceil(K/8)]
    weight_scale: torch.Tensor,  # [N, ceil(K/g)] bf16 / fp16 / fp32
    group_size: int,
    in_features: int | None = None,  # K (the checkpoint's weight_shape[1]); defaults to x.shape[1]
) -> torch.Tensor:  # [M, N], dtype of x
    """y = x · Wᵀ for a compressed-tensors pack-quantized INT4 linear (W4A16, fp32 accumulation)."""
    for name, t, dtypes in (("x", x, DTYPES), ("weight_packed", weight_packed, (torch.int32,)),
                            ("weight_scale", weight_scale, DTYPES)):  # fmt: skip
        check_matrix(name, t, dtypes)
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    M, K = x.shape
    if in_features is not None and in_features != K:
        raise ValueError(f"in_features = {in_features} but x has K = {K} columns")
    N = weight_packed.shape[0]
    if K < 1 or N < 1:
        raise ValueError(f"empty GEMM: x {tuple(x.shape)}, weight_packed {tuple(weight_packed.shape)}")
    if weight_packed.shape[1] != triton.cdiv(K, PACK):
        raise ValueError(f"weight_packed must be [N, ceil(K/8)] = [{N}, {triton.cdiv(K, PACK)}] for K = {K}, got "
                         f"{tuple(weight_packed.shape)}")  # fmt: skip
    groups = triton.cdiv(K, group_size)
    if weight_scale.shape != (N, groups):
        raise ValueError(f"weight_scale must be [N, ceil(K/group_size)] = [{N}, {groups}] for K = {K}, "
                         f"group_size = {group_size}, got {tuple(weight_scale.shape)}")  # fmt: skip
    interpreted = is_interpreted(_int4_gemm_kernel)
    check_device(x.device, interpreted)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    budget = device_smem_budget(x.device)
    block_m, block_n, block_k, after, stages = launch_tiles(M, N, group_size, groups == 1, x.element_size(), budget)
    via_fp32 = interpreted and x.dtype == torch.bfloat16
    # fp32 inputs: exact fp32 products (no TF32), so fp32 results match the fp32 reference
    precision = "ieee" if x.dtype == torch.float32 or via_fp32 else "tf32"
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int4_gemm_kernel[grid](
        x, weight_packed, weight_scale, out, M, N, K,
        x.stride(0), weight_packed.stride(0), weight_scale.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE_AFTER_DOT=after, DOT_PRECISION=precision, VIA_FP32=via_fp32, ROUND_BF16=via_fp32, num_stages=stages,
    )  # fmt: skip
    return out


__all__ = ["int4_gemm"]
