"""The target's forward at a static shape: what a CUDA graph captures and the CPU step replays.

Inputs are fixed-size tensors (no Python metadata, no host synchronisation, no data-dependent shape):
B sequences x Q rows each (a tree's root + nodes, or an AR row, padded), every sequence's keys
as a slot table of K entries:

    input_ids   int64 [B·Q]        pad rows: any id (0)
    positions   int64 [B·Q]
    write_slots int64 [B·Q]        pad rows write to the pool's pad slot (never handed out)
    key_slots   int64 [B, K]       prefix slots, then the sequence's new slots, then the pad slot
    key_bias    bf16  [B, Q, K]    added to the fp32 scores: 0 where a row sees a key, -inf where it must not
                                   (padding, the tree/causal mask); a pad row sees the pad slot only, so
                                   no row is all -inf
    rows        int64 [R]          the rows whose final-normed hidden state is returned

Every layer writes its rows into kv_cache at write_slots, then gathers the keys: the forward mutates the
cache in place, which is what a CUDA graph captures.

Attention is absorbed MLA as in attention.py, batched over sequences: one gather of every sequence's
keys, one bmm for the scores of all heads and rows, one masked softmax, one bmm for the values. The
routed experts run densely (every local expert on every row, one linear each, weighted by the router's
top-k weights, zero elsewhere): the same sum as the grouped path with no sort by expert, for small expert
counts (the demo; on CUDA a fused MoE kernel with static launch grids is the route for wide models). One
CPU row (an AR step of one sequence) runs only its top-k experts, in ascending order: the dense sum's
bits, since the skipped experts add exact zeros.
RoPE's cos/sin are computed once per forward for all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .deepseek_v3 import DeepseekV3ForCausalLM
from .mla import DeepseekV3Attention
from .moe import DeepseekV3MoE
from .rope import PositionRope


def static_forward(
    model: DeepseekV3ForCausalLM,
    input_ids: torch.Tensor,  # int64 [B·Q]
    positions: torch.Tensor,  # int64 [B·Q]
    write_slots: torch.Tensor,  # int64 [B·Q]
    key_slots: torch.Tensor,  # int64 [B, K]
    key_bias: torch.Tensor,  # bf16 [B, Q, K]: 0 seen, -inf hidden
    kv_cache: torch.Tensor,  # [num_layers, S, r + dr], written in place
    rows: torch.Tensor,  # int64 [R]
    tap_layer_ids: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> final-normed rows [R, d], taps [B·Q, F] or None."""
    rope = PositionRope(model.model.rotary_emb, positions)  # cos/sin once for every layer
    x = model.embed(input_ids)
    taps = []
    for i, layer in enumerate(model.model.layers):
        x = x + _attention(
            layer.self_attn, layer.input_layernorm(x), rope, write_slots, key_slots, key_bias, kv_cache[i]
        )
        h = layer.post_attention_layernorm(x)
        x = x + (_dense_moe(layer.mlp, h) if isinstance(layer.mlp, DeepseekV3MoE) else layer.mlp(h))
        if i in tap_layer_ids:
            taps.append(x)
    tap = torch.cat([taps[tap_layer_ids.index(i)] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
    return model.model.norm(x.index_select(0, rows)), tap


def _attention(
    attn: DeepseekV3Attention,
    h: torch.Tensor,  # [T, d]
    rope: PositionRope,
    write_slots: torch.Tensor,  # [T]
    key_slots: torch.Tensor,  # [B, K]
    key_bias: torch.Tensor,  # bf16 [B, Q, K]
    kv_layer: torch.Tensor,  # [S, r + dr], this step's rows written in place
) -> torch.Tensor:  # [T, d]
    T, H, r = h.shape[0], attn.num_heads, attn.kv_lora_rank
    B, Q, K = key_bias.shape
    q_a, latent = attn.project_a(h)  # q_a_proj and kv_a_proj_with_mqa: one GEMM where merged (mla.py)
    q = attn.q_proj(h) if q_a is None else attn.q_b_proj(attn.q_a_layernorm(q_a))
    q = q.view(T, H, attn.qk_nope_head_dim + attn.qk_rope_head_dim)
    q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    q_pe = rope(q_pe, rope.positions)
    row = torch.cat([attn.kv_a_layernorm(latent[:, :r]), rope(latent[:, r:], rope.positions)], dim=-1)
    kv_layer.index_copy_(0, write_slots, row.to(kv_layer.dtype))
    w_uk, w_uv = attn.w_uk_uv()
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r], as mla.py
    qf = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).float() * attn.softmax_scale  # [T, H, r+dr]
    keys = kv_layer.index_select(0, key_slots.flatten()).view(B, K, -1).float()  # [B, K, r+dr]
    scores = torch.bmm(qf.view(B, Q * H, -1), keys.transpose(1, 2)).view(B, Q, H, K) + key_bias[:, :, None, :]
    probs = torch.softmax(scores, dim=-1).view(B, Q * H, K)
    o_lat = torch.bmm(probs, keys[:, :, :r]).view(T, H, r).to(q_lat.dtype)
    o = torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, dv]
    return attn.o_proj(o.reshape(T, H * attn.v_head_dim))


def _dense_moe(moe: DeepseekV3MoE, x: torch.Tensor) -> torch.Tensor:  # [M, d] -> [M, d]
    """Every local expert on every row, combined with the router's weights (0 off the top-k); one CPU row
    with every expert local: only its top-k experts (the same bits).

    One linear per expert and projection (E <= static_step.DENSE_EXPERTS), each a BLAS matmul on the
    expert's own weight. The top-k's ids are read on the host (`.item()`), so that path is for the CPU: a
    CUDA graph cannot."""
    weights, idx = moe.gate(x)  # fp32 [M, k], int64 [M, k] global ids
    ex = moe.experts
    local = idx - ex.first
    if ex.expert_map is not None:
        local = ex.expert_map.long()[idx]
    keep = (local >= 0) & (local < ex.num_local)
    combine = torch.zeros(x.shape[0], ex.num_local + 1, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, torch.where(keep, local, ex.num_local), torch.where(keep, weights, 0.0))
    gate, up, down = (p.weight for p in ex.projections())  # bf16 kind only (StaticStep.supports checks)
    xs = x.to(gate.dtype)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 1 and x.device.type == "cpu" and ex.expert_map is None:
        experts = [e.item() for e in local[0].sort().values]  # the row's top-k, ascending as the loop below
    else:
        experts = range(ex.num_local)
    for e in experts:
        y = F.linear(F.silu(F.linear(xs, gate[e])) * F.linear(xs, up[e]), down[e])  # [M, d]
        out = out + y.float() * combine[:, e, None]
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x).float()
    return out.to(x.dtype)
