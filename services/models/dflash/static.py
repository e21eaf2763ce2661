"""The drafter's block forward at a static shape: what a CUDA graph captures (the drafter's half of the
static step; the target's is its own forward over a static_batch.py).

`DFlashDraftModel.forward_blocks` takes each sequence's context as a list of tensors of its own length, and
its attention runs per block. Here every input is a fixed-size tensor, so the forward has no Python
metadata, no host synchronisation and no data-dependent shape:

    block_embeds  [S, B, H]            model dtype; pad blocks: any finite values (zeros)
    positions     int64 [S, B]         each block's absolute positions (root first)
    ctx_k, ctx_v  per layer [S, C, kvh, hd]   sequence s's context K/V in rows [0, n_s), padding after
    ctx_hidden    bool [S, C]          True where a context row is padding (never seen)
    inv_freq      fp32 [hd/2]          the RoPE frequencies, on the model's device (no copy inside)

-> hidden [S, B, H] after the final norm. Block s sees its n_s context rows and its own B slots, unmasked,
as in forward_blocks: padded context rows get a -inf score, so their weight is exactly 0 and the sum is
the eager one up to the order of the matmuls' reductions (equal within fp32 rounding, not bit for bit:
forward_blocks adds the context's and the block's shares of the values separately). A pad block sees
only its own slots, so no row is all -inf. A causal head or a sliding-window layer hides keys by the one
rule of models/dflash/mask.py, built here from the inputs with tensor ops only (block s's n_s context rows
sit at the positions just before its root, as in forward_blocks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree.models.dflash.mask import block_mask, needs_mask
from ddtree.models.dflash.model import DFlashAttention, DFlashDraftModel
from ddtree.models.layers.rope import apply_rope


def static_forward_blocks(
    model: DFlashDraftModel,
    block_embeds: Tensor,  # [S, B, H]
    positions: Tensor,  # int64 [S, B]
    ctx_k: list[Tensor],  # per layer [S, C, kvh, hd]
    ctx_v: list[Tensor],  # per layer [S, C, kvh, hd]
    ctx_hidden: Tensor,  # bool [S, C]
    inv_freq: Tensor,  # fp32 [hd/2], on the model's device
) -> Tensor:  # [S, B, H]
    S, B, H = block_embeds.shape
    h = block_embeds.reshape(S * B, H)
    cos, sin = model.cos_sin(positions.reshape(S * B), inv_freq)
    # Keys seen by block s: its C context rows (padding hidden), then its own B slots (always seen).
    hidden = torch.cat([ctx_hidden, torch.zeros_like(ctx_hidden[:, :B])], dim=1)[:, None, :]  # [S, 1, C+B]
    cfg = model.config
    hidden_by_window = {}
    for w in {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}:
        if not needs_mask(cfg.causal_head, w):
            hidden_by_window[w] = hidden
            continue
        C = ctx_hidden.shape[1]
        n = (~ctx_hidden).sum(dim=1, keepdim=True)  # [S, 1] context rows of each block
        ctx_pos = positions[:, :1] - n + torch.arange(C, device=positions.device)  # [S, C]
        hidden_by_window[w] = hidden | ~block_mask(positions, ctx_pos, cfg.causal_head, w)  # [S, B, C+B]
    for i, (layer, k_ctx, v_ctx) in enumerate(zip(model.layers, ctx_k, ctx_v)):
        mask = hidden_by_window[cfg.layer_window(i)]
        h = h + _block_attention(layer.self_attn, layer.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask, S)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h).view(S, B, H)


def _block_attention(
    attn: DFlashAttention,
    x: Tensor,  # [S*B, H] after input_layernorm
    cos: Tensor,  # [S*B, hd]
    sin: Tensor,
    k_ctx: Tensor,  # [S, C, kvh, hd]
    v_ctx: Tensor,
    hidden: Tensor,  # bool [S, 1 or B, C+B]: True = not seen by (every / that) slot
    S: int,
) -> Tensor:  # [S*B, H]
    rows, nh, kvh, hd = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    B, g = rows // S, nh // kvh
    q = attn.q_norm(attn.q_proj(x).view(rows, nh, hd))
    q = apply_rope(q, cos[:, None], sin[:, None], interleaved=False)  # [S*B, nh, hd]
    k, v = attn.kv(x, cos, sin)  # [S*B, kvh, hd]
    # Query head j reads kv head j // g (grouped_attention's layout), fp32 scores, softmax and sums.
    qg = q.view(S, B, kvh, g, hd).permute(0, 2, 1, 3, 4).reshape(S, kvh, B * g, hd).float()
    keys = torch.cat([k_ctx.float(), k.view(S, B, kvh, hd).float()], dim=1)  # [S, C+B, kvh, hd]
    values = torch.cat([v_ctx.float(), v.view(S, B, kvh, hd).float()], dim=1)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * hd**-0.5  # [S, kvh, B*g, C+B]
    hide = hidden.repeat_interleave(g, dim=1) if hidden.shape[1] > 1 else hidden  # [S, B*g or 1, C+B]
    scores = scores.masked_fill(hide[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [S, kvh, B*g, hd]
    o = o.view(S, kvh, B, g, hd).permute(0, 2, 1, 3, 4).reshape(rows, nh * hd).to(q.dtype)
    return attn.o_proj(o)
