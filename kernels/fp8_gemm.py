"""FP8 block-scaled dense GEMM (W8A8, DeepSeek-V3 / R1 checkpoints): y = x · Wᵀ with W float8_e4m3fn [N, K]
and fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (block (bn, bk) = (128, 128) in those checkpoints).

Two launches, as in vLLM / SGLang / DeepSeek's inference code:

1. `per_token_group_quant_fp8`: each row of x is cut into groups of bk along K; a group's scale is
   s = max(amax, 1e-10) / 448 and its values q = clamp(x / s, ±448) rounded to e4m3 (nearest even).
2. `w8a8_block_fp8_matmul`: one program per [BLOCK_M, BLOCK_N] output tile, BLOCK_K = bk, so each K step
   meets one activation scale per row and one weight scale per column:

       acc += dot(q_x[:, k-block], q_w[n-tile, k-block]ᵀ) · s_x[:, kb, None] · s_w[n // bn, kb][None, :]

   in fp32, stored in x's dtype. Ragged M, N, K (not multiples of a tile or of 128) are masked: columns
   past K load as zero, rows / columns past M / N are not stored.

Interpreter notes (triton 3.9, TRITON_INTERPRET=1): the fp8 dot itself works (the interpreter widens e4m3
to fp16, exactly, and multiplies in fp32), but its fp32 -> fp8 cast rounds wrongly (a mantissa carry does
not reach the exponent: 1.9375 becomes 1.0), and its fp32 -> bf16 cast truncates. Interpreted kernels
therefore round to e4m3 / bf16 explicitly in fp32 (ROUND_E4M3 / ROUND_BF16), after which the casts are
exact; compiled kernels use the hardware's round-to-nearest-even casts, which give the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .latent_write import _round_bf16
from .mla_checks import DTYPES, check_device, is_interpreted
from .quant_formats import FP8_MAX
from .shared_memory import device_smem_budget, dot_smem_bytes, stages_within

FP8_EPS = 1e-10  # the amax floor of a group (an all-zero group gets scale 1e-10 / 448 and q = 0)
DEFAULT_BLOCK = (128, 128)


@triton.jit
def _round_e4m3(x):
    """fp32 with |x| <= 448 -> the nearest float8_e4m3fn value (ties to even), still as fp32."""
    # normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits of the fp32 pattern, round to nearest even
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal e4m3 (|x| < 2^-6): multiples of 2^-9; adding 2^14 (whose fp32 ulp is 2^-9) rounds to them
    a = tl.abs(x)
    sub = (a + 16384.0) - 16384.0
    sub = tl.where((bits >> 31) != 0, -sub, sub)  # the sign bit: -0.0 and tiny negatives stay negative
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _group_quant_kernel(
    X, Q, S, M, K, stride_xm, stride_qm, stride_sm, eps,
    GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, ROUND_E4M3: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK_G)
    ok = (rows < M)[:, None] & ((tl.arange(0, BLOCK_G) < GROUP) & (cols < K))[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), eps)  # [BLOCK_ROWS]
    s = tl.math.div_rn(amax, 448.0)  # IEEE division, as torch's (a bare / may be approximate on a GPU)
    q = tl.math.div_rn(x, s[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if ROUND_E4M3:
        q = _round_e4m3(q)
    tl.store(Q + rows[:, None] * stride_qm + cols[None, :], q.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + rows * stride_sm + g, s, mask=rows < M)


@triton.jit
def _fp8_block_gemm_kernel(
    A, AS, B, BS, C, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = B + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: Wᵀ tile
    as_ptrs = AS + offs_m * stride_asm  # [BLOCK_M]: scale of the row's group kb at as_ptrs + kb
    bs_ptrs = BS + (offs_n // SCALE_N) * stride_bsn  # [BLOCK_N]: scale block of each column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]  # fp8 x fp8 -> fp32 (e4m3 products are exact)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if ROUND_BF16:
        acc = _round_bf16(acc)
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check_2d(name: str, t, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not supported; use one of {dtypes}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")


def _check_fp8_device(device: torch.device, interpreted: bool) -> None:
    check_device(device, interpreted)
    if device.type == "cuda" and not interpreted and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"the FP8 kernels need an sm_89+ GPU (Ada / Hopper) for float8_e4m3fn, {device} is "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")  # fmt: skip


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/group)]) with x ≈ q · scale per group."""
    _check_2d("x", x, DTYPES)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    M, K = x.shape
    if K < 1:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    interpreted = is_interpreted(_group_quant_kernel)
    _check_fp8_device(x.device, interpreted)
    groups = triton.cdiv(K, group_size)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    block_rows = min(16, triton.next_power_of_2(M))
    _group_quant_kernel[(triton.cdiv(M, block_rows), groups)](
        x, q, scale, M, K, x.stride(0), q.stride(0), scale.stride(0), FP8_EPS,
        GROUP=group_size, BLOCK_ROWS=block_rows, BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        ROUND_E4M3=interpreted,
    )  # fmt: skip
    return q, scale


def _gemm_tiles(M: int, N: int) -> tuple[int, int]:
    block_m = min(64, max(16, triton.next_power_of_2(M)))  # tl.dot needs every dim >= 16
    block_n = 64 if N <= 64 else 128
    return block_m, block_n


def smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int) -> int:
    """shared_memory's estimate: the e4m3 activation and weight tiles per buffer, and the weight's scales."""
    return dot_smem_bytes(num_stages, block_m, [(block_m, block_k, 1), (block_k, block_n, 1)], [(1, block_n, 4)])


def w8a8_block_fp8_matmul(
    q: torch.Tensor,  # float8_e4m3fn [M, K]: activations quantized per token group of block[1]
    q_scale: torch.Tensor,  # fp32 [M, ceil(K/bk)]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = DEFAULT_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # [M, N] out_dtype
    """The block-scaled GEMM on already quantized activations: y = (q · s) (W · s_w)ᵀ."""
    bn, bk = _check_block(block_size)
    _check_2d("q", q, (torch.float8_e4m3fn,))
    _check_2d("weight", weight, (torch.float8_e4m3fn,))
    _check_2d("q_scale", q_scale, (torch.float32,))
    _check_2d("weight_scale_inv", weight_scale_inv, (torch.float32,))
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not supported; use one of {DTYPES}")
    (M, K), (N, Kw) = q.shape, weight.shape
    if Kw != K or K < 1 or N < 1:
        raise ValueError(f"q [M, K] {tuple(q.shape)} and weight [N, K] {tuple(weight.shape)} do not fit")
    if q_scale.shape != (M, triton.cdiv(K, bk)):
        raise ValueError(f"q_scale must be [M, ceil(K/{bk})] = [{M}, {triton.cdiv(K, bk)}], got {tuple(q_scale.shape)}")
    want = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    if weight_scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv must be [ceil(N/{bn}), ceil(K/{bk})] = [{want[0]}, {want[1]}] for "
                         f"weight {tuple(weight.shape)}, got {tuple(weight_scale_inv.shape)}")  # fmt: skip
    for name, t in (("q_scale", q_scale), ("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    interpreted = is_interpreted(_fp8_block_gemm_kernel)
    _check_fp8_device(q.device, interpreted)
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    if M == 0:
        return out
    block_m, block_n = _gemm_tiles(M, N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    stages = stages_within(device_smem_budget(q.device), lambda s: smem_bytes(block_m, block_n, bk, s))
    _fp8_block_gemm_kernel[grid](
        q, q_scale, weight, weight_scale_inv, out, M, N, K,
        q.stride(0), q_scale.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0),
        SCALE_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        ROUND_BF16=interpreted and out_dtype == torch.bfloat16, num_stages=stages,
    )  # fmt: skip
    return out


def fp8_block_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:  # [M, N], dtype of x
    """y = x · Wᵀ for a DeepSeek-V3 FP8 linear: quantize x per token group of bk, then the block GEMM."""
    _check_2d("x", x, DTYPES)
    _, bk = _check_block(block_size)
    if weight.dim() == 2 and x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] {tuple(x.shape)} and weight [N, K] {tuple(weight.shape)} do not fit")
    q, scale = per_token_group_quant_fp8(x, bk)
    return w8a8_block_fp8_matmul(q, scale, weight, weight_scale_inv, block_size, x.dtype)


def _check_block(block_size) -> tuple[int, int]:
    if not (
        isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(isinstance(b, int) for b in block_size)
    ):
        raise ValueError(f"block_size must be (block_n, block_k) ints, got {block_size!r}")  # fmt: skip
    bn, bk = block_size
    if bn < 1 or bk < 32 or bk & (bk - 1):  # an 8-bit tl.dot needs K >= 32 on NVIDIA GPUs
        raise ValueError(f"block_size {tuple(block_size)}: block_n must be >= 1 and block_k a power of two >= 32 "
                         "(it is the kernel's BLOCK_K: one scale per K step)")  # fmt: skip
    return bn, bk


__all__ = ["FP8_EPS", "FP8_MAX", "fp8_block_gemm", "per_token_group_quant_fp8", "w8a8_block_fp8_matmul"]
