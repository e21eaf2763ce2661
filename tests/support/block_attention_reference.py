"""A brute-force DFlash / JetSpec draft block, written from the published description only (not from the
serving code): per query slot, per head, a loop over the keys it may see, in float64.

The drafter (DFlash layout): the committed tokens' target features are fused once (fc -> hidden_norm) and
become every layer's context keys / values at their absolute positions; the block [root, MASK, ...] runs
through Qwen3 layers (RMSNorm, q/k norms, rotate-half RoPE, SwiGLU) as queries over [context ; block].
Which keys a slot sees (JetSpec / Qwen3 configs):
  - causal_head: slot i sees the context and block slots j <= i; otherwise every slot of its block;
  - a sliding_attention layer with window W: only keys whose position differs from the query's by < W.
Which slots carry predictions: draft_shift false: slot d predicts depth d (slots 1..B-1); true: slot d
predicts depth d + 1 (slots 0..B-2). Logits are the target's LM head over the final norm.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x: Tensor, pos: int, theta: float) -> Tensor:
    """x [hd] at absolute position pos: rotate-half RoPE, pair (i, i + hd/2) turned by pos / theta^(2i/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    angle = pos / theta ** (torch.arange(half, dtype=torch.float64) * 2 / hd)  # [hd/2]
    c, s = torch.cos(angle), torch.sin(angle)
    lo, hi = x[:half], x[half:]
    return torch.cat([lo * c - hi * s, hi * c + lo * s])


def reference_logits(
    state: dict[str, Tensor],
    cfg,
    features: Tensor,  # [n, F] the committed tokens just before the root
    block_embeds: Tensor,  # [B, H] the block's input embeddings (root, masks)
    root_pos: int,
    lm_head: Tensor,  # [V, H]
) -> Tensor:  # float64 [B-1, V]: row d-1 = depth d
    w = {k: v.double() for k, v in state.items()}
    n, B = features.shape[0], block_embeds.shape[0]
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g, eps, theta = nh // kvh, cfg.rms_norm_eps, cfg.rope.theta
    ctx_pos = [root_pos - n + t for t in range(n)]
    blk_pos = [root_pos + i for i in range(B)]
    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [n, H]
    h = block_embeds.double().clone()
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        window = cfg.sliding_window if cfg.layer_types and cfg.layer_types[layer] == "sliding_attention" else 0
        x = _rms(h, w[p + "input_layernorm.weight"], eps)

        def keys_values(rows: Tensor, positions: list[int], p: str = p) -> tuple[list[Tensor], list[Tensor]]:
            k = (rows @ w[p + "self_attn.k_proj.weight"].T).view(-1, kvh, hd)
            v = (rows @ w[p + "self_attn.v_proj.weight"].T).view(-1, kvh, hd)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
            ks = [torch.stack([_rope(k[r, j], positions[r], theta) for j in range(kvh)]) for r in range(len(positions))]
            return ks, [v[r] for r in range(len(positions))]

        ck, cv = keys_values(ctx, ctx_pos)
        bk, bv = keys_values(x, blk_pos)
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        out = torch.zeros(B, nh, hd, dtype=torch.float64)
        for i in range(B):
            seen = []  # (key, value) pairs query slot i may see
            for t in range(n):
                if window == 0 or blk_pos[i] - ctx_pos[t] < window:
                    seen.append((ck[t], cv[t]))
            for j in range(B):
                if cfg.causal_head and j > i:
                    continue
                if window and abs(blk_pos[i] - blk_pos[j]) >= window:
                    continue
                seen.append((bk[j], bv[j]))
            for head in range(nh):
                qi = _rope(q[i, head], blk_pos[i], theta)
                kv_head = head // g
                scores = torch.stack([qi @ k[kv_head] for k, _ in seen]) / math.sqrt(hd)
                probs = torch.softmax(scores, 0)
                out[i, head] = sum(pr * v[kv_head] for pr, (_, v) in zip(probs, seen))
        h = h + out.reshape(B, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = y @ w[p + "mlp.gate_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    final = _rms(h, w["norm.weight"], eps)
    slots = range(0, B - 1) if cfg.draft_shift else range(1, B)
    return torch.stack([final[s] for s in slots]) @ lm_head.double().T
