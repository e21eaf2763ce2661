"""Batched training forward of `DeepseekV3ForCausalLM`: the same weights as the serving forward, over
[B, T] token blocks with plain causal attention and no KV cache.

- MLA in the naive (non-absorbed) form: per-head k_nope and v are expanded through kv_b_proj and attention
  runs through torch SDPA with `is_causal=True` (mla.py shows both forms compute the same scores).
- MoE: the router picks experts exactly as in serving and the routed experts run through the same
  grouped path (moe_grouped.py: tokens sorted by expert, one grouped matmul per projection, differentiable
  for the bf16/fp32 stacked weights). The per-expert token counts come back so the trainer can apply the
  aux-loss-free bias update.

Every position of a block is a new token; positions are 0..T-1 unless given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.models.deepseek_v3.mla import DeepseekV3Attention
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.moe import DeepseekV3MoE
from ddtree.models.layers.rope import RotaryEmbedding


@dataclass(frozen=True, eq=False)
class TrainingOutput:
    logits: torch.Tensor  # fp32 [B, T, vocab] (or hidden [B, T, d] when return_hidden)
    expert_load: dict[int, torch.Tensor]  # MoE layer index -> int64 [n_routed_experts] tokens routed per expert


def mla_causal(
    attn: DeepseekV3Attention, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
) -> torch.Tensor:
    """h [B, T, d] normalised hidden states, positions int64 [T] -> attention output [B, T, d]."""
    B, T, _ = h.shape
    H, dn, dv, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    flat = h.reshape(B * T, -1)
    pos = positions.repeat(B)  # [B*T]
    q_nope, q_pe = attn.project_q(flat, pos, rope)  # [B*T, H, dn], [B*T, H, dr]
    lat = attn.project_latent(flat, pos, rope)  # [B*T, r+dr]
    kv = attn.kv_b_proj(lat[:, :r]).view(B, T, H, dn + dv)
    k_pe = lat[:, r:].view(B, T, 1, -1).expand(B, T, H, lat.shape[-1] - r)
    q = torch.cat([q_nope, q_pe], dim=-1).view(B, T, H, -1).transpose(1, 2)  # [B, H, T, dn+dr]
    k = torch.cat([kv[..., :dn], k_pe], dim=-1).transpose(1, 2)  # [B, H, T, dn+dr]
    v = kv[..., dn:].transpose(1, 2)  # [B, H, T, dv]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.softmax_scale)  # [B, H, T, dv]
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, H * dv))


def moe_grouped(moe: DeepseekV3MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> (y [N, d], tokens per expert int64 [E]). Same math as DeepseekV3MoE.forward."""
    weights, idx = moe.gate(x)  # fp32 [N, k], int64 [N, k]
    counts = torch.bincount(idx.flatten(), minlength=moe.experts.num_experts)  # [E]
    y = moe.experts(x, weights, idx)  # grouped over experts; backward through torch._grouped_mm
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y, counts


def training_forward(
    model: DeepseekV3ForCausalLM,
    input_ids: torch.Tensor,  # int64 [B, T]
    positions: torch.Tensor | None = None,  # int64 [T]; default 0..T-1
    return_hidden: bool = False,
) -> TrainingOutput:
    B, T = input_ids.shape
    if positions is None:
        positions = torch.arange(T, device=input_ids.device)
    rope = model.model.rotary_emb
    x = model.model.embed_tokens(input_ids)  # [B, T, d]
    loads: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        x = x + mla_causal(layer.self_attn, layer.input_layernorm(x), positions, rope)
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, DeepseekV3MoE):
            y, loads[i] = moe_grouped(layer.mlp, h.reshape(B * T, -1))
            x = x + y.view(B, T, -1)
        else:
            x = x + layer.mlp(h)
    x = model.model.norm(x)
    if return_hidden:
        return TrainingOutput(logits=x, expert_load=loads)
    return TrainingOutput(logits=model.lm_head(x).float(), expert_load=loads)


@torch.no_grad()
def update_expert_bias(model: DeepseekV3ForCausalLM, loads: dict[int, torch.Tensor], gamma: float) -> None:
    """DeepSeek-V3 aux-loss-free balancing: bias_e += gamma * sign(mean load - load_e) per MoE layer."""
    for i, load in loads.items():
        gate = model.model.layers[i].mlp.gate
        load = load.float()
        gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
