"""Torch reference of a fused MoE call (test oracle): a loop over the local experts that got tokens,
fp32 math on dequantized weights.

    out[t] = Σ_{j : expert_map[ids[t, j]] >= 0}  w[t, j] · down_e( silu(gate_e(x_t)) · up_e(x_t) )

with e = expert_map[ids[t, j]] (the identity when expert_map is None). Experts of other ranks
contribute nothing (expert parallel: the decoder layer all-reduces the ranks' partial sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.kernels.moe.weights import ExpertWeights, check_routing


def fused_moe_reference(
    x: torch.Tensor,  # [M, d]
    gate: ExpertWeights,  # [E, I, d]
    up: ExpertWeights,  # [E, I, d]
    down: ExpertWeights,  # [E, d, I]
    topk_weights: torch.Tensor,  # float [M, k]
    topk_ids: torch.Tensor,  # int [M, k] global expert ids
    expert_map: torch.Tensor | None = None,  # int32 [E_global]: local slot or -1
) -> torch.Tensor:  # [M, d], dtype of x
    num_global = gate.num_experts if expert_map is None else expert_map.shape[0]
    check_routing(topk_ids, topk_weights, x.shape[0], num_global, expert_map, values=True)
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]  # [M, k]
    out = torch.zeros(x.shape[0], down.out_features, dtype=torch.float32)
    xf = x.float().cpu()
    for e in sorted(set(local.flatten().tolist()) - {-1}):
        rows, slots = (local.cpu() == e).nonzero(as_tuple=True)
        h = F.silu(xf[rows] @ gate.dequantize(e).cpu().T) * (xf[rows] @ up.dequantize(e).cpu().T)
        y = (h @ down.dequantize(e).cpu().T) * topk_weights.cpu().float()[rows, slots, None]
        out.index_add_(0, rows, y)
    return out.to(x.dtype).to(x.device)
