"""The device path's row-invariant GEMMs on a model's linears (docs/design.md, row invariance).

With the Triton layer kernels (layer_kernels.py) a row's result must depend only on that row, never on how
many rows share the step. cuBLAS (and the CPU's BLAS) choose kernel, tile and split-K from M, so the plain
`nn.Linear` layers run `ddtree.kernels.gemm.dense` instead (one tile shape per weight shape), and the
packed INT4 / FP8 linears and the stacked experts run their Triton kernels off CUDA too (interpreted on a
CPU), where they would otherwise dequantize and call F.linear / the grouped torch MoE.

`route_linears(model, on)` switches a model's modules in place, once per choice (the model's forward calls it
when its layer kernels change): plain linears by class (`DeviceLinear` is an nn.Linear with the same
parameters, so state dicts and loaders see no difference), packed ones by their `device_path` flag, and the
INT4 routed experts' words into pair order (kernels/quant_formats.py), which the fused MoE unpacks fastest.
"""

from __future__ import annotations

import torch
from torch import nn


class DeviceLinear(nn.Linear):
    """nn.Linear whose forward is kernels/gemm/dense.py (x in the weight's dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        # triton is an optional extra (the runtime install has none): only the device path, which needs it
        from ddtree.kernels.gemm.dense import dense_gemm

        bias = None if self.bias is None else self.bias.to(x.dtype)
        return dense_gemm(x, self.weight.to(x.dtype), bias)


def route_linears(model: nn.Module, on: bool) -> None:
    """Every plain linear of `model` to DeviceLinear (on) or back to nn.Linear; `device_path` of every module
    that has the flag (packed linears, stacked experts) set to `on`; INT4 routed experts' words in the pair
    order the fused MoE unpacks fastest (on) or back in the checkpoint's (StackedProjection.set_pair_order)."""
    for module in model.modules():
        if hasattr(module, "set_pair_order"):
            module.set_pair_order(on)
        if on and type(module) is nn.Linear:
            module.__class__ = DeviceLinear
        elif not on and type(module) is DeviceLinear:
            module.__class__ = nn.Linear
        if hasattr(module, "device_path"):
            module.device_path = on
