"""A MoE layer's routed experts as three stacked tensors, in the checkpoint's format (docs/design.md §5, §6).

`StackedExperts` (the model's `mlp.experts`) holds the experts [lo, hi) of `num_experts` global ones
(all of them, or a rank's share under expert parallelism) as `gate_proj`, `up_proj`, `down_proj`, each a
`StackedProjection` over the E = hi - lo local experts in one of the kinds of kernels/moe/weights.py:

    bf16: weight [E, N, K] (the model dtype; a trainable Parameter)
    int4: weight_packed int32 [E, N, ceil(K/8)], weight_scale [E, N, ceil(K/g)], weight_shape int32 [E, 2]
    fp8:  weight float8_e4m3fn [E, N, K], weight_scale_inv fp32 [E, ceil(N/bn), ceil(K/bk)]

gate/up are [E, I, d], down [E, d, I]. `state_dict()` still has the checkpoint's per-expert names,
`experts.{g}.{proj}.{leaf}` for global id g, as views of slot g - lo (so the loader fills the stacked
tensors in place through them), and `load_state_dict` accepts them. Local slot of global expert g:
`expert_map[g]` (-1 for another rank's).

Forward (routed part only, [M, d] in x's dtype): on CUDA the Triton fused MoE (`ddtree.kernels.moe.fused`)
when installed and no gradient is wanted; otherwise the grouped torch path (moe_grouped.py), which is
differentiable for kind bf16 (training).
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.kernels.moe.weights import ExpertWeights
from ddtree.kernels.quant_formats import pair_int4_words, unpair_int4_words
from ddtree.kernels.weight_formats import weight_format
from ddtree.models.deepseek_v3.moe_grouped import grouped_moe
from ddtree.models.layers.packed_linear import KeepsPackedDtypes, cuda_kernel

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PAIR_CHUNK_WORDS = 1 << 22  # set_pair_order's words at a time: int64 temporaries of 2^25 bytes each


class StackedProjection(KeepsPackedDtypes):
    """One projection of every local expert, [E, N, K] in `kind` (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        out_features: int,
        in_features: int,
        kind: str = "bf16",
        group_size: int = 0,
        block: tuple[int, int] = (128, 128),
        scale_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        E, N, K = num_experts, out_features, in_features
        self.kind, self._shape = kind, (N, K)
        self.fmt = weight_format(kind)
        self.group_size, self.block = group_size, (int(block[0]), int(block[1]))
        if self.fmt.packed:
            for leaf, t in self.fmt.empty(E, N, K, group_size, self.block, scale_dtype).items():
                self.register_buffer(leaf, t)
            self.PACKED_LEAVES: tuple[str, ...] = self.fmt.leaves
        else:
            self.weight = nn.Parameter(torch.empty(E, N, K))
            self.PACKED_LEAVES = ()
        self.paired = False  # int4: the words in pair order (set_pair_order), as the device path reads them

    @property
    def out_features(self) -> int:  # N (bf16: of the weight itself, which a test may have resized on meta)
        return self._shape[0] if self.fmt.packed else self.weight.shape[1]

    @property
    def in_features(self) -> int:  # K
        return self._shape[1] if self.fmt.packed else self.weight.shape[2]

    @property
    def leaves(self) -> tuple[str, ...]:
        """The per-expert state-dict leaves, in checkpoint order."""
        return self.PACKED_LEAVES or ("weight",)

    def expert_weights(self) -> ExpertWeights:
        """The kernel contract's view of the same tensors (no copy): the format's stored weight and its scale."""
        weight, scale = (getattr(self, leaf) for leaf in self.leaves[:2]) if self.fmt.packed else (self.weight, None)
        return ExpertWeights(
            self.kind, weight, self.out_features, self.in_features, scale, self.group_size, block=self.block,
            paired=self.paired,
        )  # fmt: skip

    def set_pair_order(self, on: bool) -> None:
        """int4: rewrite the words in place, a few experts at a time (no second copy of the stack: at most
        PAIR_CHUNK_WORDS words in flight), into pair order (on: what the fused MoE unpacks without byte
        permutes) or back to the checkpoint's; the tensor keeps its storage (a CUDA graph captured over it
        stays valid). Other kinds: nothing to do.
        A state dict taken in pair order is not a checkpoint: the serving engines never save one."""
        if self.kind != "int4" or self.paired == on:
            return
        words = getattr(self, self.leaves[0])  # int32 [E, N, ceil(K/8)]
        move = pair_int4_words if on else unpair_int4_words
        if words.device.type != "meta" and words.numel():
            step = max(1, PAIR_CHUNK_WORDS // words[0].numel())
            for e in range(0, words.shape[0], step):
                words[e : e + step].copy_(move(words[e : e + step]))
        self.paired = on

    def extra_repr(self) -> str:
        n = getattr(self, self.leaves[0]).shape[0]
        fmt = self.fmt.describe(self.group_size, self.block)
        return f"experts={n}, out_features={self.out_features}, in_features={self.in_features}, {self.kind}{fmt}"


class StackedExperts(nn.Module):
    """Routed experts [lo, hi) of `num_experts`: out = Σ_j w_j · down(silu(gate(x)) · up(x)) over local ones."""

    device_path = False  # the fused MoE off CUDA too (interpreted): device_linear.route_linears sets it

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, expert_range: tuple[int, int] | None = None
    ):
        super().__init__()
        lo, hi = expert_range or (0, num_experts)
        if not 0 <= lo < hi <= num_experts:
            raise ValueError(f"expert range [{lo}, {hi}) not within {num_experts} experts")
        self.num_experts, self.first, self.num_local = num_experts, lo, hi - lo
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        E, d, inter = hi - lo, hidden_size, intermediate_size
        self.gate_proj = StackedProjection(E, inter, d)
        self.up_proj = StackedProjection(E, inter, d)
        self.down_proj = StackedProjection(E, d, inter)
        # global id -> local slot, -1 = another rank's; None when every expert is local. Built on the CPU even
        # under torch.device("meta") (like RoPE's inv_freq): it is not in the checkpoint.
        expert_map = None
        if E < num_experts:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device="cpu")
            expert_map[lo:hi] = torch.arange(E, dtype=torch.int32, device="cpu")
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stack_loaded_state_dict)

    def projections(self) -> tuple[StackedProjection, StackedProjection, StackedProjection]:
        return self.gate_proj, self.up_proj, self.down_proj

    def set_projection(self, name: str, proj: StackedProjection) -> None:
        """Replace one projection (the loader does, on the meta model, for a quantized checkpoint)."""
        old = getattr(self, name)
        if (proj.out_features, proj.in_features) != (old.out_features, old.in_features):
            raise ValueError(f"{name}: [{proj.out_features}, {proj.in_features}] != the layer's shape")
        setattr(self, name, proj)

    def forward(
        self,
        x: torch.Tensor,  # [M, d]
        topk_weights: torch.Tensor,  # fp32 [M, k]
        topk_ids: torch.Tensor,  # int64 [M, k] global expert ids
    ) -> torch.Tensor:  # [M, d], dtype of x: this rank's experts' part
        wants_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if (x.is_cuda or self.device_path) and not wants_grad:
            y = self.fused(x, topk_weights, topk_ids)
            if y is not None:
                return y
        gate, up, down = (p.expert_weights() for p in self.projections())
        return grouped_moe(x, gate, up, down, topk_weights, topk_ids, self.expert_map)

    def fused(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor | None:
        """The Triton fused MoE (ddtree.kernels.moe.fused) on these weights; None when it is not installed."""
        kernel = cuda_kernel("fused_moe")
        if kernel is None:
            return None
        gate, up, down = (p.expert_weights() for p in self.projections())
        return kernel(x, gate, up, down, topk_weights, topk_ids, expert_map=self.expert_map).to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts [{self.first}, {self.first + self.num_local}) of {self.num_experts}"


def _per_expert_state_dict(module: StackedExperts, state_dict, prefix: str, local_metadata) -> None:
    """`{prefix}{proj}.{leaf}` [E, ...] -> `{prefix}{g}.{proj}.{leaf}` [...] (views), expert-major like HF.

    The module's entries are the last ones of `state_dict` when its post-hook runs, so re-adding them
    keeps the model's order (random_checkpoint.py draws tensors in that order)."""
    stacked = {}
    for name, proj in zip(PROJECTIONS, module.projections(), strict=True):
        for leaf in proj.leaves:
            stacked[name, leaf] = state_dict.pop(f"{prefix}{name}.{leaf}")
    for i in range(module.num_local):
        for name, proj in zip(PROJECTIONS, module.projections(), strict=True):
            for leaf in proj.leaves:
                state_dict[f"{prefix}{module.first + i}.{name}.{leaf}"] = stacked[name, leaf][i]


def _stack_loaded_state_dict(module: StackedExperts, state_dict, prefix: str, *args) -> None:
    """The inverse: per-expert entries (when all of them are there) become the stacked ones."""
    for name, proj in zip(PROJECTIONS, module.projections(), strict=True):
        for leaf in proj.leaves:
            keys = [f"{prefix}{module.first + i}.{name}.{leaf}" for i in range(module.num_local)]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{name}.{leaf}"] = torch.stack([state_dict.pop(k) for k in keys])
