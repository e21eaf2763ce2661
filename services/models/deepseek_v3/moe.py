"""Dense MLP and the DeepSeek-V3 MoE block (docs/design.md §5). State-dict names mirror the checkpoint:
`mlp.{gate,up,down}_proj` (dense), `mlp.gate.{weight,e_score_correction_bias}`,
`mlp.experts.{e}.{gate,up,down}_proj.*` (stacked per projection in moe_experts.py),
`mlp.shared_experts.{gate,up,down}_proj`.

Every forward takes the model's `LayerKernels` (layer_kernels.py; the torch path by default): the router
then runs as one Triton launch and the MLP's SiLU-and-mul as another."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.moe_experts import StackedExperts
from ddtree.models.layers.layer_kernels import TORCH_KERNELS, LayerKernels
from ddtree.models.layers.merged_linear import is_merged, register_merged


class DeepseekV3MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the dense layers and the shared experts (routed ones: moe_experts.py).

    gate and up are one GEMM: `gate_up_proj` [2I, d], gate rows first (merged_linear.py; the state dict
    still shows `gate_proj.weight` / `up_proj.weight`, views of it). A quantized checkpoint whose blocks
    cannot be concatenated (FP8 with I not a multiple of the block rows) keeps them apart (pack_modules)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden_size, bias=False)
        register_merged(self, {"gate_up_proj": (("gate_proj", inter), ("up_proj", inter))},
                        ("gate_proj", "up_proj", "down_proj"))  # fmt: skip

    def forward(self, x: torch.Tensor, kernels: LayerKernels = TORCH_KERNELS) -> torch.Tensor:  # [N, d] -> [N, d]
        if is_merged(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(x)  # [N, 2I]
            inter = gate_up.shape[-1] // 2
            return self.down_proj(kernels.silu_mul(gate_up[..., :inter], gate_up[..., inter:]))
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DeepseekV3TopkRouter(nn.Module):
    """Sigmoid router with aux-loss-free bias correction and group-limited top-k.

    `weight` and `e_score_correction_bias` are fp32 even in a bf16 model (HF `_keep_in_fp32_modules_strict`).
    """

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, kernels: LayerKernels = TORCH_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights fp32 [N, k], expert ids int64 [N, k]). With Triton kernels one launch
        (ddtree.kernels.moe.router) reads `weight` as stored; ids are then in descending score order."""
        if kernels.route is not None:
            return kernels.route(x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group,
                                 self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)  # fmt: skip
        N = x.shape[0]
        logits = F.linear(x.float(), self.weight.float())  # [N, E] fp32
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()  # bias affects selection only
        if self.n_group == 1:  # one group, always kept: no group limit
            idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
            return self._weights(scores, idx)
        grouped = choice.view(N, self.n_group, self.n_experts // self.n_group)  # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G] sum of the top-2 per group
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
        group_keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~group_keep[:, :, None], float("-inf")).view(N, self.n_experts)
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, k]
        return self._weights(scores, idx)

    def _weights(self, scores: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = scores.gather(1, idx)  # unbiased scores
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, idx


class DeepseekV3MoE(nn.Module):
    """y = Σ_j w_j · expert_{idx_j}(x) + shared_experts(x).

    The routed experts are stacked per projection (moe_experts.py `StackedExperts`; state-dict names
    still `experts.{e}.{proj}.*`). Expert parallel (parallel/tp_model.py): `keep_experts(lo, hi)` leaves
    this rank experts [lo, hi) only, so each rank sums its own experts' part for all tokens and the
    decoder layer all-reduces."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = DeepseekV3TopkRouter(config)
        self.experts = StackedExperts(d, inter, config.n_routed_experts)
        self.shared_experts = DeepseekV3MLP(d, inter * config.n_shared_experts) if config.n_shared_experts > 0 else None

    def keep_experts(self, lo: int, hi: int) -> None:
        """Hold routed experts [lo, hi) only (build time, before loading: the new tensors are uninitialised)."""
        e = self.experts
        self.experts = StackedExperts(e.hidden_size, e.intermediate_size, e.num_experts, (lo, hi))

    def forward(self, x: torch.Tensor, kernels: LayerKernels = TORCH_KERNELS) -> torch.Tensor:  # [N, d] -> [N, d]
        weights, idx = self.gate(x, kernels)  # [N, k] fp32, [N, k]
        out = self.experts(x, weights, idx)  # one grouped matmul per projection (no loop over experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, kernels)
        return out
