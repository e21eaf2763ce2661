"""FP8 block-scaled dense GEMM (W8A8, DeepSeek-V3 / R1 checkpoints): y = x · Wᵀ with W float8_e4m3fn [N, K]
and fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (block (bn, bk) = (128, 128) in those checkpoints).

One launch (`_fp8_gemm_kernel`): the activations are quantized per token group of bk inside the GEMM, as
vLLM / SGLang / DeepSeek's inference code do in a separate launch before it. One program per
[BLOCK_M, BLOCK_N] output tile, BLOCK_K = bk, so each K step covers exactly one activation group per row
and meets one weight scale per column. Per K step the program loads x's tile [BLOCK_M, bk] in x's dtype and

    s   = max(amax_row, 1e-10) / 448                    (fp32, IEEE division: div_rn)
    q   = e4m3(clamp(x / s, ±448))                       (IEEE division, round to nearest even)
    acc += dot(q, q_w[n-tile, k-block]ᵀ) · s[:, None] · s_w[n // bn, kb][None, :]

in fp32, stored in x's dtype: the same values, in the same order, as quantizing x to (q, s) in memory first
and running the block GEMM on them (gemm.dense_reference.fp8_block_gemm_reference is that two-step path in
torch), so the result is bit for bit the one of the two-launch version. The cost paid to drop the launch:
each output column tile re-quantizes its rows (ceil(N / BLOCK_N) times per row group instead of once), and
the activation tile is read in x's dtype (2 or 4 bytes, not 1). Ragged M, N, K (not multiples of a tile or
of 128) are masked: columns past K load as zero (they do not change a group's amax), rows / columns past
M / N are not stored.

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

from ddtree.kernels.checks import DTYPES, check_device, check_matrix, is_interpreted
from ddtree.kernels.mla.latent_write import _round_bf16
from ddtree.kernels.quant_formats import FP8_MAX
from ddtree.kernels.shared_memory import device_smem_budget, dot_smem_bytes, stages_within

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
def _fp8_gemm_kernel(
    X, B, BS, C, M, N, K,
    stride_xm, stride_bn, stride_bsn, stride_cm, eps,
    SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_E4M3: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """C[m-tile, n-tile] = Σ_kb dot(e4m3(x / s), W_kbᵀ) · s · s_w; BLOCK_K is the activation group (bk)."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]: one group per row
    b_ptrs = B + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: Wᵀ tile
    bs_ptrs = BS + (offs_n // SCALE_N) * stride_bsn  # [BLOCK_N]: scale block of each column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # the group's scale and e4m3 values (rows past M: x = 0, so q = 0 and nothing is stored)
        a_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), eps), 448.0)  # [BLOCK_M]; IEEE, as torch's /
        q = tl.math.div_rn(x, a_s[:, None])  # a bare / may be approximate on a GPU
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if ROUND_E4M3:
            q = _round_e4m3(q)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        # fp8 x fp8 -> fp32 (e4m3 products are exact)
        acc += tl.dot(q.to(B.dtype.element_ty), b) * a_s[:, None] * b_s[None, :]
        x_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if ROUND_BF16:
        acc = _round_bf16(acc)
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check_fp8_device(device: torch.device, interpreted: bool) -> None:
    check_device(device, interpreted)
    if device.type == "cuda" and not interpreted and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"the FP8 kernels need an sm_89+ GPU (Ada / Hopper) for float8_e4m3fn, {device} is "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")  # fmt: skip


ROW_BLOCK_M = 64  # rows per tile at every M (row invariance; docs/performance.md counts the cost at small M)


def _gemm_tiles(M: int, N: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): one tile shape per weight shape, never from M (row invariance)."""
    block_m = ROW_BLOCK_M
    block_n = 64 if N <= 64 else 128
    return block_m, block_n


def smem_bytes(block_m: int, block_n: int, block_k: int, x_bytes: int, num_stages: int) -> int:
    """shared_memory's estimate: per buffer the activation tile as loaded (x's dtype, x_bytes) and the e4m3
    weight tile; once the activation tile quantized in registers, the dot's operand, which Triton 3.9 stages
    at two bytes an element for sm_90's mma.sync (one on sm_120; tests/support/aot_shared_memory.py)."""
    loop = [(block_m, block_k, x_bytes), (block_k, block_n, 1)]
    return dot_smem_bytes(num_stages, block_m, loop, [(block_m, block_k, 2)])


def fp8_block_gemm(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale_inv: torch.Tensor,  # fp32 [ceil(N/bn), ceil(K/bk)]
    block_size: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:  # [M, N], dtype of x
    """y = x · Wᵀ for a DeepSeek-V3 FP8 linear, x quantized per token group of bk inside the GEMM (one launch)."""
    bn, bk = _check_block(block_size)
    check_matrix("x", x, DTYPES)
    check_matrix("weight", weight, (torch.float8_e4m3fn,))
    check_matrix("weight_scale_inv", weight_scale_inv, (torch.float32,))
    (M, K), (N, Kw) = x.shape, weight.shape
    if Kw != K or K < 1 or N < 1:
        raise ValueError(f"x [M, K] {tuple(x.shape)} and weight [N, K] {tuple(weight.shape)} do not fit")
    want = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    if weight_scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv must be [ceil(N/{bn}), ceil(K/{bk})] = [{want[0]}, {want[1]}] for "
                         f"weight {tuple(weight.shape)}, got {tuple(weight_scale_inv.shape)}")  # fmt: skip
    for name, t in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    interpreted = is_interpreted(_fp8_gemm_kernel)
    _check_fp8_device(x.device, interpreted)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m, block_n = _gemm_tiles(M, N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    smem = lambda s: smem_bytes(block_m, block_n, bk, x.element_size(), s)  # noqa: E731
    stages = stages_within(device_smem_budget(x.device), smem)
    _fp8_gemm_kernel[grid](
        x, weight, weight_scale_inv, out, M, N, K,
        x.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0), FP8_EPS,
        SCALE_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, ROUND_E4M3=interpreted,
        ROUND_BF16=interpreted and x.dtype == torch.bfloat16, num_stages=stages,
    )  # fmt: skip
    return out


def _check_block(block_size) -> tuple[int, int]:
    if not (
        isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(isinstance(b, int) for b in block_size)
    ):
        raise ValueError(f"block_size must be (block_n, block_k) ints, got {block_size!r}")  # fmt: skip
    bn, bk = block_size
    if bn < 1 or bk < 32 or bk & (bk - 1):  # an 8-bit tl.dot needs K >= 32 on NVIDIA GPUs
        raise ValueError(f"block_size {tuple(block_size)}: block_n must be >= 1 and block_k a power of two >= 32 "
                         "(it is the kernel's BLOCK_K and the activation group: one scale per K step)")  # fmt: skip
    return bn, bk


__all__ = ["FP8_EPS", "FP8_MAX", "fp8_block_gemm"]
