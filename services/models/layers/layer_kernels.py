"""Which code runs the decoder layer's small ops: the torch path or one-launch Triton kernels.

`LayerKernels` is chosen once, when the model is built (DeepseekV3ForCausalLM(kernels=...); by default
the attention backend's name: "triton" on CUDA, "torch" on the CPU), and the model's forward passes it
down to every layer: nothing is decided per call. "torch" is the CPU path with HF's numerics (norm.py,
the router and MLP code of moe.py); "triton" runs ddtree.kernels.rmsnorm (RMSNorm, fused residual add +
RMSNorm), ddtree.kernels.moe.router (the router in one launch), ddtree.kernels.activation (SiLU-and-mul
after the fused gate/up GEMM) and ddtree.kernels.rope (the queries' rotary embedding). On a CPU,
"triton" runs them under the Triton interpreter and needs TRITON_INTERPRET=1 set before triton is first
imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.models.layers.norm import add_rms_norm, rms_norm

KERNEL_CHOICES = ("torch", "triton")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [N, I], [N, I] -> [N, I]
    return F.silu(gate) * up


@dataclass(frozen=True)
class LayerKernels:
    name: str
    rms_norm: Callable  # (x [..., d], weight [d], eps) -> [..., d]
    add_rms_norm: Callable  # (x, residual [..., d], weight [d], eps) -> (normed, residual + x)
    silu_mul: Callable  # (gate [N, I], up [N, I]) -> silu(gate) · up [N, I]
    # (x [N, d], weight [E, d], bias [E], top_k, n_group, topk_group, renormalize, scaling)
    #   -> (weights fp32 [N, k], ids int64 [N, k]); None: the router module's own torch code
    route: Callable | None = None
    # (q_pe [T, H, dr], cos fp32 [T, dr/2], sin fp32 [T, dr/2]) -> rotated [T, H, dr], the forward's
    # PositionRope tables; None: PositionRope's own torch code
    rope_q: Callable | None = None
    # (x [T, H, K], weight [H, N, K]) -> per head x · weightᵀ [T, H, N] (MLA's absorptions), row invariant;
    # None: torch.bmm. Set with the Triton kernels, which also put the linears on the device path's GEMMs
    # (device_linear.route_linears, by the model's forward).
    head_gemm: Callable | None = None


TORCH_KERNELS = LayerKernels("torch", rms_norm, add_rms_norm, silu_mul)


def make_layer_kernels(name: str) -> LayerKernels:
    if name == "torch":
        return TORCH_KERNELS
    if name == "triton":
        # triton is an optional extra (the runtime install has none): its kernels load only when chosen
        from ddtree.kernels import activation, rmsnorm, rope
        from ddtree.kernels.gemm import dense as dense_gemm
        from ddtree.kernels.moe import router

        return LayerKernels(
            "triton", rmsnorm.rms_norm, rmsnorm.add_rms_norm, activation.silu_mul, router.route, rope.rope_q,
            dense_gemm.head_gemm,
        )  # fmt: skip
    raise ValueError(f"unknown layer kernels {name!r}; choices: {list(KERNEL_CHOICES)}")
