"""SiLU-and-mul, one launch: out = silu(gate) · up, for the MLPs whose gate and up projections run as one
GEMM (services/models/deepseek_v3/moe.py DeepseekV3MLP: gate_up [N, 2I], gate rows first).

Numerics are torch's `F.silu(gate) * up` in the input dtype: silu(g) = g / (1 + exp(-g)) in fp32, rounded
to the dtype, then the product in fp32, rounded again (bf16 rounding as explicit bit arithmetic, which
keeps the interpreter exact). exp is Triton's, so a result may differ from torch's in the last fp32 bit
before rounding. Reference: layer_reference.silu_and_mul_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted
from ddtree.kernels.rmsnorm import _TL, _round_to

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    GATE, UP, OUT, n_cols, stride_g, stride_u, stride_o,
    DTYPE: tl.constexpr, IS_BF16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    g = tl.load(GATE + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UP + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    s = _round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), DTYPE, IS_BF16)
    y = _round_to(s * u, DTYPE, IS_BF16)
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (one dtype; rows may be strided views, e.g. the halves of one gate_up) -> [N, I]."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} / up {tuple(up.shape)} must be one [N, I] shape")
    if gate.dtype not in DTYPES or up.dtype != gate.dtype:
        raise ValueError(f"gate / up dtypes {gate.dtype} / {up.dtype} must be one of {DTYPES}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device}, gate on {gate.device}")
    check_device(gate.device, is_interpreted(_silu_mul_kernel))
    if gate.numel() and gate.stride(1) != 1:
        gate = gate.contiguous()
    if up.numel() and up.stride(1) != 1:
        up = up.contiguous()
    N, inter = gate.shape
    out = torch.empty(N, inter, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(N, triton.cdiv(inter, block))](
            gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0),
            DTYPE=_TL[gate.dtype], IS_BF16=gate.dtype == torch.bfloat16, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate columns first) -> silu(gate) · up [N, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    return silu_mul(gate_up[:, :inter], gate_up[:, inter:])
