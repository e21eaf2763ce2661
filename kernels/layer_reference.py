"""Torch references for the decoder layer's small kernels (rmsnorm.py, activation.py, moe/router.py): test
oracles written from the HF DeepseekV3 definitions, each mirroring one kernel wrapper's arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF DeepseekV3RMSNorm: normalise in fp32, cast back to x's dtype, multiply by the weight."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * n.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual), the sum in x's dtype."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate first) -> silu(gate) · up [N, I] in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def route_ref(
    x: torch.Tensor,  # [N, d]
    weight: torch.Tensor,  # [E, d]
    bias: torch.Tensor,  # [E]
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights fp32 [N, k], ids int64 [N, k] (order of ids unspecified)
    """HF DeepseekV3TopkRouter + get_topk_indices: sigmoid scores in fp32, bias for selection only, groups
    ranked by the sum of their top-2 biased scores (the others -inf), top-k, unbiased weights."""
    N, E = x.shape[0], weight.shape[0]
    scores = F.linear(x.float(), weight.float()).sigmoid()  # [N, E]
    choice = scores + bias.float()
    grouped = choice.view(N, n_group, E // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if E // n_group > 1 else grouped[..., 0]  # [N, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids
