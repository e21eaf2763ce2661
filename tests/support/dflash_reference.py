"""A from-scratch float64 reference of one DFlash block forward (tests of the DFlash model, native and published layouts)."""

from __future__ import annotations

import math

import torch

from ddtree.models.dflash.config import DFlashConfig


def naive_block(state: dict[str, torch.Tensor], cfg: DFlashConfig, ctx_feats, ctx_pos, embeds, blk_pos):
    """Recompute everything from scratch: per head, explicit RoPE on (j, j + hd/2) pairs, softmax."""
    w = {k: v.double() for k, v in state.items()}
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [T, hd]
        out = torch.empty_like(x)
        half = hd // 2
        for j in range(half):
            theta = pos.double() * cfg.rope.theta ** (-2.0 * j / hd)
            c, s = torch.cos(theta), torch.sin(theta)
            out[:, j] = x[:, j] * c - x[:, j + half] * s
            out[:, j + half] = x[:, j + half] * c + x[:, j] * s
        return out

    ctx = rms(ctx_feats.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embeds.double()
    all_pos = torch.cat([ctx_pos, blk_pos])
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        x = rms(h, w[p + "input_layernorm.weight"])
        src = torch.cat([ctx, x])  # keys/values come from context features and block slots
        heads = []
        for head in range(nh):
            kv = head // (nh // nkv)
            q = rope(
                rms(
                    x @ w[p + "self_attn.q_proj.weight"][head * hd : (head + 1) * hd].T,
                    w[p + "self_attn.q_norm.weight"],
                ),
                blk_pos,
            )
            k = rope(
                rms(
                    src @ w[p + "self_attn.k_proj.weight"][kv * hd : (kv + 1) * hd].T, w[p + "self_attn.k_norm.weight"]
                ),
                all_pos,
            )
            v = src @ w[p + "self_attn.v_proj.weight"][kv * hd : (kv + 1) * hd].T
            heads.append(torch.softmax(q @ k.T / math.sqrt(hd), dim=-1) @ v)
        h = h + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])
