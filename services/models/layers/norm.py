"""RMSNorm exactly as HF DeepseekV3RMSNorm: normalise in fp32, cast back, then multiply by the weight.

`rms_norm` / `add_rms_norm` are the torch path of the decoder layer's norms (layer_kernels.py picks them
or their one-launch Triton twins, ddtree.kernels.rmsnorm). `add_rms_norm(x, residual)` is the residual
stream's step: the layer's output `x` is added to the running `residual` (in the model dtype, as
`residual + x` was) and the sum is normalised, so a layer returns its output and the residual apart
(vLLM / SGLang) and the add and the norm are one launch on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d] -> [..., d]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # fp32: the same numbers, one op
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same shape and dtype
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
