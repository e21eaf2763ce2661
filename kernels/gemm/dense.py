"""Dense GEMM with one tile shape per weight shape: y = x · Wᵀ (+ b) for the model's unquantized linears on the
device path (bf16 / fp16 / fp32), in place of cuBLAS.

Row invariance (docs/design.md): cuBLAS picks its kernel, tile and split-K from M, so a row's sum order
follows how many rows share the launch (a 17-row verify tree against AR's one row). Here every launch uses
BLOCK_M = 64 and BLOCK_K = 64, fp32 accumulation and no atomics; BLOCK_N and a FIXED number of K chunks are
chosen from the weight's shape and the device's SM count alone, never from M (`gemm_tiles`): row m's
result is a function of x[m] and W alone, and a weight's K order is one on a device.

The rule, for a weight [Bt, N, K] (Bt = 1 for a linear, the heads for head_gemm) on `sms` SMs:
- BLOCK_N = 128, or 64 when N <= 64 or Bt x ceil(N / 128) tiles leave SMs idle;
- P = Bt x ceil(N / BLOCK_N) programs per M tile. S = min(ceil(sms / P), K // K_CHUNK_MIN) chunks (1 when
  that is <= 1) of K_CHUNK = ceil(K / S) rounded up to BLOCK_K columns (then S = ceil(K / K_CHUNK)).
S = 1: one program per (m tile, n tile, b) runs K from 0 upwards and writes the output. S > 1: program
(m tile, n tile, b * S + s) sums chunk s's K tiles in order from zero and stores its fp32 partial to a
scratch [Bt, S, M, N]; a second launch (`_dense_gemm_sum_kernel`, elementwise) adds the partials in chunk
order 0, 1, ..., S - 1, then the bias, and rounds once to the output dtype. At Kimi K2.6 TP 8 on 132 SMs
(H200): q_a + kv_a [2112, 7168] 33 tiles x 4 chunks, q_b [1536, 1536] 24 x 3, o_proj [7168, 1024] 112 x 2,
shared expert gate_up [512, 7168] 8 x 14, down [7168, 256] 112 x 1, the LM head [20480, 7168] 160 x 1,
MLA's per-head absorptions 1 chunk. The partials add 2 x S x M x N x 4 bytes beside the weight, and a
split weight one launch (docs/performance.md).

Interpreter (triton 3.9): its bf16 dot multiplies raw bits and its fp32 -> bf16 cast truncates, so interpreted
bf16 runs the dot in fp32 (exact products of bf16 values) and rounds the output to bf16 explicitly
(latent_write._round_bf16), as the INT4 GEMM does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted
from ddtree.kernels.mla.latent_write import _round_bf16
from ddtree.kernels.mla.plan import num_sms
from ddtree.kernels.shared_memory import device_smem_budget, dot_smem_bytes, stages_within

BLOCK_M = 64  # rows per tile at every M
BLOCK_K = 64
K_CHUNK_MIN = 512  # least columns per K chunk (as the router's K_SPLIT): a split smaller weights would pay in a launch
SUM_BLOCK = 128  # outputs per program of the partials' sum (elementwise: any tile keeps the order)


@triton.jit
def _dense_gemm_kernel(
    X, W, B, Y, M, N, K, K_TOTAL,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_yb, stride_ys, stride_ym,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, VIA_FP32: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Program (m tile, n tile, b * SPLITS + s): Y[b, s, m-tile, n-tile] = Σ_k-tiles of chunk s X[b] · W[b]ᵀ
    (+ B), k-tiles in order from the chunk's first. K: the columns of a chunk (K_TOTAL when SPLITS = 1, a
    multiple of BLOCK_K otherwise); K_TOTAL: x's columns. Y: the output (SPLITS = 1) or the fp32 partials."""
    pid_b = tl.program_id(2)
    b = (pid_b // SPLITS).to(tl.int64)
    split = (pid_b % SPLITS).to(tl.int64)
    k_lo = split * K
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + b * stride_xb + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk  # [BM, BK]
    w_ptrs = W + b * stride_wb + offs_n[None, :] * stride_wn + (k_lo + offs_k)[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K_TOTAL - k_lo - kb * BLOCK_K
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
    tl.store(Y + b * stride_yb + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _dense_gemm_sum_kernel(
    PARTS, B, Y, M, N, total, stride_pb, stride_ps, stride_pm, stride_yb, stride_ym,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Y[b, m, n] = ((PARTS[b, 0] + PARTS[b, 1]) + ... + PARTS[b, SPLITS - 1]) (+ B[n]) in fp32, chunk order;
    BLOCK of the total = Bt x M x N outputs per program (flat index (b x M + m) x N + n)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    n = i % N
    m = (i // N) % M
    b = i // N // M
    ptrs = PARTS + b * stride_pb + m * stride_pm + n
    acc = tl.load(ptrs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(ptrs + s * stride_ps, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + n, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(Y + b * stride_yb + m * stride_ym + n, acc.to(Y.dtype.element_ty), mask=ok)


def smem_bytes(block_n: int, x_bytes: int, num_stages: int) -> int:
    """shared_memory's estimate: the x and weight tiles per buffer."""
    return dot_smem_bytes(num_stages, BLOCK_M, [(BLOCK_M, BLOCK_K, x_bytes), (BLOCK_K, block_n, x_bytes)], [])


def gemm_tiles(batch: int, N: int, K: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, K chunks S, columns per chunk) of a weight [batch, N, K] on `sms` SMs: never from M."""
    block_n = 64 if N <= 64 or batch * triton.cdiv(N, 128) < sms else 128
    programs = batch * triton.cdiv(N, block_n)
    want = min(triton.cdiv(sms, programs), K // K_CHUNK_MIN)
    if want <= 1:
        return block_n, 1, K
    chunk = triton.cdiv(triton.cdiv(K, want), BLOCK_K) * BLOCK_K
    return block_n, triton.cdiv(K, chunk), chunk


def _launch(x, weight, bias, out) -> None:
    """x [Bt, M, K], weight [Bt, N, K], out [Bt, M, N] (views, any strides but out's last = 1)."""
    Bt, M, K = x.shape
    N = weight.shape[1]
    if M == 0 or N == 0 or Bt == 0:
        return
    interpreted = is_interpreted(_dense_gemm_kernel)
    check_device(x.device, interpreted)
    block_n, splits, chunk = gemm_tiles(Bt, N, K, num_sms(x.device))
    stages = stages_within(device_smem_budget(x.device), lambda s: smem_bytes(block_n, x.element_size(), s))
    via_fp32 = interpreted and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or via_fp32 else "tf32"
    has_bias = bias is not None
    # one chunk: the program writes the output; S chunks: fp32 partials [Bt, S, M, N], summed in order after
    parts = out if splits == 1 else torch.empty(Bt, splits, M, N, dtype=torch.float32, device=x.device)
    p_b, p_s, p_m = (out.stride(0), 0, out.stride(1)) if splits == 1 else parts.stride()[:3]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, block_n), Bt * splits)
    _dense_gemm_kernel[grid](
        x, weight, bias if has_bias and splits == 1 else parts, parts, M, N, chunk, K,
        *x.stride(), *weight.stride(), p_b, p_s, p_m,
        SPLITS=splits, HAS_BIAS=has_bias and splits == 1, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision, VIA_FP32=via_fp32, ROUND_BF16=via_fp32 and splits == 1, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        total = Bt * M * N
        _dense_gemm_sum_kernel[(triton.cdiv(total, SUM_BLOCK),)](
            parts, bias if has_bias else parts, out, M, N, total, p_b, p_s, p_m, out.stride(0), out.stride(1),
            SPLITS=splits, HAS_BIAS=has_bias, BLOCK=SUM_BLOCK, ROUND_BF16=via_fp32,
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


__all__ = ["dense_gemm", "head_gemm", "gemm_tiles"]
