"""Which part of each checkpoint tensor a tensor-parallel rank holds (docs/design.md §7.5).

A pure function of (name, config, rank, world size, expert parallel). Shapes are the logical
(dequantized) 2-D weights, [out, in] as nn.Linear stores them:

| tensor | rank r of N holds |
|---|---|
| `embed_tokens`, `lm_head` [V, d] | rows V/N·r … (vocab-parallel) |
| `q_proj` / `q_b_proj` [H·qk, ·], `kv_b_proj` [H·(dn+dv), r] | the rows of heads H/N·r … (column-parallel) |
| `o_proj.weight` [d, H·dv] | the columns of the same heads (row-parallel) |
| dense and shared-expert `gate_proj`, `up_proj` [I, d] | rows I/N·r … (column-parallel) |
| dense and shared-expert `down_proj` [d, I] | columns I/N·r … (row-parallel) |
| routed experts, tensor parallel | as the dense MLP, with moe_intermediate_size |
| routed experts, expert parallel | experts E/N·r … whole; the others are skipped |
| everything else (q_a / kv_a projections, norms, router, `o_proj.bias`) | all of it (replicated) |
"""

from __future__ import annotations

import dataclasses
import re

from ddtree.models.deepseek_v3.config import DeepseekV3Config


@dataclasses.dataclass(frozen=True)
class TensorSlice:
    """The part of one weight a rank owns: [start, stop) along `dim` of the logical (dequantized) 2-D
    weight; dim 0 for a 1-D tensor."""

    dim: int
    start: int
    stop: int


def shard_range(size: int, rank: int, world_size: int, what: str = "size") -> tuple[int, int]:
    """[start, stop) of rank's equal share of `size`; raises when it does not divide."""
    if size % world_size:
        raise ValueError(f"{what} {size} is not divisible by tensor parallel size {world_size}")
    n = size // world_size
    return rank * n, (rank + 1) * n


_ATTN_COLS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MLP = re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    config: DeepseekV3Config
    rank: int
    world_size: int
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} not in [0, {n})")
        shard_range(c.num_attention_heads, 0, n, "num_attention_heads")
        shard_range(c.vocab_size, 0, n, "vocab_size")
        shard_range(c.intermediate_size, 0, n, "intermediate_size")
        if c.n_shared_experts:
            shard_range(c.moe_intermediate_size * c.n_shared_experts, 0, n, "shared expert width")
        if self.expert_parallel:
            shard_range(c.n_routed_experts, 0, n, "n_routed_experts")
        else:
            shard_range(c.moe_intermediate_size, 0, n, "moe_intermediate_size")

    def _rows(self, size: int) -> tuple[int, int]:
        return shard_range(size, self.rank, self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self._rows(self.config.vocab_size)

    @property
    def expert_range(self) -> tuple[int, int]:
        """[lo, hi) of the routed experts this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return 0, self.config.n_routed_experts
        return self._rows(self.config.n_routed_experts)

    def skip(self, name: str) -> bool:
        """True for tensors this rank does not hold at all (other ranks' experts under EP)."""
        m = _EXPERT.search(name)
        if m is None:
            return False
        lo, hi = self.expert_range
        return not lo <= int(m.group(1)) < hi

    def slice_of(self, name: str) -> TensorSlice | None:
        """The part of `name` this rank holds; None = the whole tensor (replicated, or a whole EP expert)."""
        c = self.config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(0, *self.vocab_range)
        if _ATTN_COLS.search(name):
            per_head = c.qk_head_dim if "kv_b_proj" not in name else c.qk_nope_head_dim + c.v_head_dim
            lo, hi = self._rows(c.num_attention_heads)
            return TensorSlice(0, lo * per_head, hi * per_head)
        if name.endswith(".self_attn.o_proj.weight"):
            lo, hi = self._rows(c.num_attention_heads)
            return TensorSlice(1, lo * c.v_head_dim, hi * c.v_head_dim)
        m = _EXPERT.search(name)
        if m is not None:
            if self.expert_parallel:
                return None
            return self._mlp_slice(m.group(2), c.moe_intermediate_size)
        m = _MLP.search(name)
        if m is not None:
            width = c.moe_intermediate_size * c.n_shared_experts if m.group(1) else c.intermediate_size
            return self._mlp_slice(m.group(2), width)
        return None

    def _mlp_slice(self, proj: str, width: int) -> TensorSlice:
        lo, hi = self._rows(width)
        return TensorSlice(1 if proj == "down_proj" else 0, lo, hi)
