"""The DFlash drafter's training forward: many draft blocks per sequence in one batched pass.

Serving (services/drafter/engine.py) runs one block at a time: the context is the drafter K/V of the
committed tokens [0, a) (the last `window` of them), and the block [anchor, MASK x (B-1)] at positions
a..a+B-1 attends, without a mask, to [context ; its own block]. Training packs m anchors per sequence
into one query set and one key set:

    keys    = [context positions 0..T-1 ; block 0 ; block 1 ; ... ; block m-1]    (T + m*B)
    queries = [block 0 ; block 1 ; ... ; block m-1]                               (m*B)

and a block-sparse mask gives every query of block j exactly what serving would give it: context keys
p with a_j - W <= p < a_j (W = window, 0 = unlimited) and the B keys of block j, nothing else; a causal
head or a sliding-window layer hides more, by the serving rule (models/dflash/mask.py), per layer. The
context K/V are computed once per sequence and shared by all its blocks, as serving caches them once.
Masked keys get exactly zero weight, so each block's hidden states equal the serving computation (the
train/serve test in tests/training/test_train_drafter.py checks this against DraftEngine.draft).

The math per layer is DFlashAttention's, written for a leading batch dimension; the weights are the
DFlashDraftModel's own modules, so training updates exactly what load_drafter loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.models.dflash.mask import block_mask, needs_mask
from ddtree.models.dflash.model import DFlashDraftModel
from ddtree.models.layers.rope import apply_rope


def sample_anchors(lo: int, hi: int, count: int, batch: int, generator: torch.Generator) -> Tensor:
    """int64 [batch, m]: per row m = min(count, hi - lo + 1) distinct sorted positions in [lo, hi]."""
    if hi < lo:
        raise ValueError(f"no anchor position fits: [{lo}, {hi}] is empty")
    span = hi - lo + 1
    m = min(count, span)
    keys = torch.rand(batch, span, generator=generator)  # a random permutation per row
    return keys.argsort(dim=1)[:, :m].sort(dim=1).values + lo


def block_attention_mask(
    anchors: Tensor, context_len: int, block_size: int, window: int = 0, causal: bool = False, layer_window: int = 0
) -> Tensor:
    """bool [S, m*B, T + m*B], True = the query may see the key.

    anchors int64 [S, m]. Query row j*B + i (slot i of block j) sees context key p iff
    a_j - window <= p < a_j (no lower bound when window == 0), and block key T + j'*B + i' iff j' == j;
    of those, what dflash_mask.block_mask(causal, layer_window) lets slot i see.
    """
    s, m = anchors.shape
    b, t = block_size, context_len
    a = anchors.repeat_interleave(b, dim=1)[:, :, None]  # [S, m*B, 1] anchor of each query row
    p = torch.arange(t, device=anchors.device)[None, None, :]  # [1, 1, T]
    ctx = p < a
    if window > 0:
        ctx = ctx & (p >= a - window)
    qb = torch.arange(m * b, device=anchors.device) // b  # [m*B] block of each query row
    own = (qb[:, None] == qb[None, :]).expand(s, -1, -1)  # [S, m*B, m*B]
    if needs_mask(causal, layer_window):
        q_pos = anchors[:, :, None] + torch.arange(b, device=anchors.device)  # [S, m, B]
        rule = block_mask(q_pos, torch.arange(t, device=anchors.device), causal, layer_window)  # [S, m, B, T+B]
        ctx = ctx & rule[..., :t].reshape(s, m * b, t)
        slot = torch.arange(m * b, device=anchors.device) % b
        own = own & rule[0, 0, :, t:][slot[:, None], slot[None, :]]  # the in-block rule, the same for every block
    return torch.cat([ctx, own], dim=2)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., n, heads, hd], cos/sin [..., n, hd]: the drafter's rotate-half RoPE with leading dims."""
    return apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved=False)


def _cos_sin(model: DFlashDraftModel, positions: Tensor) -> tuple[Tensor, Tensor]:
    """positions int64 [...] -> cos, sin [..., hd] (the model's own RoPE, any leading shape)."""
    cos, sin = model.cos_sin(positions.reshape(-1))
    return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def block_hidden(
    model: DFlashDraftModel, features: Tensor, block_embeds: Tensor, anchors: Tensor, window: int = 0
) -> Tensor:
    """Hidden states of all draft blocks after the final norm.

    features [S, T, F] target taps of every position; block_embeds [S, m, B, H] (already scaled by
    input_embedding_scale); anchors int64 [S, m] -> [S, m, B, H]. Differentiable in the model weights.
    """
    cfg = model.config
    s, t, _ = features.shape
    _, m, b, h_dim = block_embeds.shape
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev = model.device
    ctx = model.hidden_norm(model.fc(features.to(dev, model.dtype)))  # [S, T, H]
    ctx_cos, ctx_sin = _cos_sin(model, torch.arange(t, device=dev))  # [T, hd]
    blk_pos = (anchors.to(dev)[:, :, None] + torch.arange(b, device=dev)).reshape(s, m * b)  # [S, mB]
    blk_cos, blk_sin = _cos_sin(model, blk_pos)  # [S, mB, hd]
    masks = {  # per distinct layer window: [S, 1, mB, T+mB]
        w: block_attention_mask(anchors.to(dev), t, b, window, cfg.causal_head, w)[:, None]
        for w in {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}
    }
    h = block_embeds.to(dev, model.dtype).reshape(s, m * b, h_dim)  # [S, mB, H]
    groups = nh // kvh
    for li, layer in enumerate(model.layers):
        mask = masks[cfg.layer_window(li)]
        attn = layer.self_attn
        kc = _rope(attn.k_norm(attn.k_proj(ctx).view(s, t, kvh, hd)), ctx_cos, ctx_sin)  # [S, T, kvh, hd]
        vc = attn.v_proj(ctx).view(s, t, kvh, hd)
        x = layer.input_layernorm(h)
        q = _rope(attn.q_norm(attn.q_proj(x).view(s, m * b, nh, hd)), blk_cos, blk_sin)  # [S, mB, nh, hd]
        kb = _rope(attn.k_norm(attn.k_proj(x).view(s, m * b, kvh, hd)), blk_cos, blk_sin)
        vb = attn.v_proj(x).view(s, m * b, kvh, hd)
        k = torch.cat([kc.to(kb.dtype), kb], dim=1).repeat_interleave(groups, dim=2)  # [S, T+mB, nh, hd]
        v = torch.cat([vc.to(vb.dtype), vb], dim=1).repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=hd**-0.5
        )  # [S, nh, mB, hd]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(s, m * b, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h).view(s, m, b, h_dim)


def block_inputs(ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """int64 [S, m, B] block token ids: [ids[a], MASK, ..., MASK] per anchor a (ids [S, T])."""
    s, m = anchors.shape
    out = torch.full((s, m, block_size), mask_token_id, dtype=torch.long, device=ids.device)
    out[:, :, 0] = ids.gather(1, anchors.to(ids.device))
    return out


def block_labels(greedy: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """int64 [S, m, B-1]: slot k of the block at anchor a is labelled greedy[a + k - 1], the target's
    own choice for position a + k given the sequence's prefix (greedy [S, T], row t = argmax at t)."""
    k = torch.arange(1, block_size, device=anchors.device)
    idx = anchors[:, :, None] + k - 1  # [S, m, B-1]
    s, m, d = idx.shape
    return greedy.gather(1, idx.reshape(s, m * d).to(greedy.device)).view(s, m, d)


def block_teacher(rows: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """rows [S, T, ...] (the target's per-position teacher rows: top-K logits or their ids) -> [S, m, B-1, ...]:
    depth k of the block at anchor a reads row a + k - 1, the target's law for position a + k (as block_labels)."""
    k = torch.arange(1, block_size, device=anchors.device)
    idx = (anchors[:, :, None] + k - 1).to(rows.device)  # [S, m, B-1]
    s, m, d = idx.shape
    flat = idx.reshape(s, m * d)
    picked = rows[torch.arange(s, device=rows.device)[:, None], flat]  # [S, m*(B-1), ...]
    return picked.view(s, m, d, *rows.shape[2:])
