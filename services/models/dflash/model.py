"""DFlash block-diffusion drafter: Qwen3-style layers whose module names are the checkpoint's weight names.

The drafter has no embedding table and no LM head: the caller embeds the block with the TARGET's
`embed_tokens` and projects hidden states with the TARGET's `lm_head` (compute_logits).

Per committed token, the target's tapped residual-stream features [len(ids) * H_t] are fused once
(fc -> hidden_norm), and every layer turns that same fused feature into context K/V (k_proj, k_norm,
RoPE at the token's absolute position; v_proj). Context features are never queries and are not
updated from layer to layer, so their K/V are computed once and cached (context_kv). A draft block
[anchor, MASK x (B-1)] then runs through the layers as queries that attend, without a mask, to
[context K/V ; block K/V] (forward_block): unmasked for DFlash's bidirectional block over full-attention
layers; a causal head (config causal_head) or a sliding-window layer masks by models/dflash/mask.py. The
block's slots that carry predictions are config.prediction_slots (draft_shift).

The layers are the target's shared ones: RMSNorm (norm.py), the SwiGLU MLP (moe.DeepseekV3MLP, the same
gate/up/down_proj block as Qwen3's) and RoPE frequencies (rope.py), here in the rotate-half layout with
cos/sin in the model dtype, as HF Qwen3 (the target rotates interleaved pairs in fp32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ddtree.models.deepseek_v3.moe import DeepseekV3MLP
from ddtree.models.dflash.config import DFlashConfig
from ddtree.models.dflash.mask import block_mask, needs_mask
from ddtree.models.layers.norm import RMSNorm
from ddtree.models.layers.rope import apply_rope, rope_attention_factor, rope_cos_sin, yarn_inv_freq


def rope_inv_freq(cfg: DFlashConfig) -> tuple[Tensor, float]:
    """(inv_freq fp32 [head_dim/2] on CPU, cos/sin scale) as HF's ROPE_INIT_FUNCTIONS default / linear / yarn.

    A yarn config.json may leave original_max_position_embeddings out; HF then uses max_position_embeddings.
    The scale is the YaRN attention factor (1.0 otherwise): rope_scaling.attention_factor when given, else
    transformers' rule (dflash_config.ATTENTION_FACTOR_HELP); q and k both take it, the logits its square.
    """
    rope = cfg.rope
    if rope.is_yarn and not rope.original_max_position_embeddings:
        rope = dataclasses.replace(rope, original_max_position_embeddings=cfg.max_position_embeddings)
    return yarn_inv_freq(rope, cfg.head_dim), rope_attention_factor(rope)


def grouped_attention(
    q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float, mask: Tensor | None = None
) -> Tensor:
    """Grouped-query attention of one block over keys/values given in parts (the cached context,
    then the block's own): q [B, nh, hd], keys[j] / values[j] [n_j, kvh, hd] -> [B, nh, hd] (q's dtype).
    The result is attention over the parts' concatenation; the parts are never concatenated: scores are
    computed per part and joined ([kvh, B·g, sum n_j], small), and the weighted sum adds each part's share,
    so a long context is read in place, not copied at every layer of every draft. mask: None (every key
    seen) or bool [B, sum n_j], True where query b sees the key (dflash_mask.block_mask; no row empty).

    Query head h reads kv head h // (nh / kvh) (as repeat_interleave, or SDPA's enable_gqa). Scores,
    softmax and the weighted sum are fp32 whatever the model dtype (a part already in fp32 is read as is).
    Bmm over [kvh, B·g, n] rather than SDPA: for a few queries over a long context, CPU SDPA costs more
    (the block is 8 rows, the context up to the window; docs/performance.md).
    """
    B, nh, hd = q.shape
    kvh = keys[0].shape[1]
    g = nh // kvh
    qg = q.view(B, kvh, g, hd).permute(1, 0, 2, 3).reshape(kvh, B * g, hd).float()  # [kvh, B*g, hd]
    scores = torch.cat([torch.bmm(qg, k.float().permute(1, 2, 0)) for k in keys], dim=-1) * scale  # [kvh, B*g, n]
    if mask is not None:  # row b*g + j is query b's head j of the group
        scores = scores.masked_fill(~mask.repeat_interleave(g, dim=0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o, start = None, 0
    for v in values:  # o = sum_j probs[:, :, part j] @ V_j
        n = v.shape[0]
        share = torch.bmm(probs[:, :, start : start + n], v.float().transpose(0, 1))  # [kvh, B*g, hd]
        o = share if o is None else o.add_(share)
        start += n
    return o.view(kvh, B, g, hd).permute(1, 0, 2, 3).reshape(B, nh, hd).to(q.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [n, H] -> K [n, kvh, hd] (k_norm, RoPE), V [n, kvh, hd]. Same op for context and block."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos[:, None], sin[:, None], interleaved=False), v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        contexts: Sequence[tuple[Tensor, Tensor]],
        masks: Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        """x [S*B, H] (S blocks of B slots, after input_layernorm), cos/sin [S*B, hd], contexts[s] = block s's
        context (K, V) [n_s, kvh, hd] -> [S*B, H]. Block s sees its own context and its own B slots, all of
        them unless masks[s] (bool [B, n_s + B], dflash_mask.block_mask) hides some.

        Projections run over all S*B rows at once; the attention core runs per block, since contexts differ
        in length (grouped_attention per block; padding every block to the longest context measured slower:
        the padded copies cost more than the calls they save)."""
        rows, nh, hd = x.shape[0], self.num_heads, self.head_dim
        b = rows // len(contexts)
        q = self.q_norm(self.q_proj(x).view(rows, nh, hd))
        q = apply_rope(q, cos[:, None], sin[:, None], interleaved=False)  # [S*B, nh, hd]
        k, v = self.kv(x, cos, sin)  # [S*B, kvh, hd]
        out = torch.empty_like(q)
        for s, (ctx_k, ctx_v) in enumerate(contexts):
            blk = slice(s * b, (s + 1) * b)  # keys: the context [n_s], then the block's own B slots
            mask = None if masks is None else masks[s]
            out[blk] = grouped_attention(q[blk], (ctx_k, k[blk]), (ctx_v, v[blk]), hd**-0.5, mask)
        return self.o_proj(out.reshape(rows, nh * hd))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        contexts: Sequence[tuple[Tensor, Tensor]],
        masks: Sequence[Tensor | None] | None = None,
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, contexts, masks)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A plain CPU fp32 tensor, not a buffer: `.to(dtype=bfloat16)` on the model (drafter/factory.py) must
        # not round the frequencies, and the state_dict holds the checkpoint's weights only.
        self._inv_freq, self._rope_scale = rope_inv_freq(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def cos_sin(self, positions: Tensor, inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """positions [n] -> rotate-half cos, sin [n, hd] in the model dtype (computed in fp32, as HF), for
        apply_rope(..., interleaved=False) on q and k of every layer. `inv_freq`: the frequencies already on
        positions' device (`inv_freq_on(device)`), so that nothing is copied from the host (a CUDA graph)."""
        freqs = self._inv_freq if inv_freq is None else inv_freq
        return rope_cos_sin(positions, freqs, self._rope_scale, interleaved=False, dtype=self.dtype)

    def inv_freq_on(self, device: torch.device) -> Tensor:
        """The fp32 RoPE frequencies [hd/2] on `device` (a copy for static-shape forwards)."""
        return self._inv_freq.to(device)

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """features [n, len(ids) * H_t], positions [n] (absolute) -> per layer (K, V) [n, kvh, hd]."""
        n = features.shape[0]
        if features.dim() != 2 or features.shape[1] != self.config.feature_size:
            raise ValueError(f"features must be [n, {self.config.feature_size}], got {tuple(features.shape)}")
        if positions.shape != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
        ctx = self.hidden_norm(self.fc(features.to(self.device, self.dtype)))  # [n, H]
        cos, sin = self.cos_sin(positions.to(self.device))
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward_block(
        self, block_embeds: Tensor, block_positions: Tensor, context: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """block_embeds [B, H], block_positions [B], context per layer (K, V) [n, kvh, hd] (or [] for
        none) -> hidden [B, H] after the final norm. The context rows are the n positions just before the
        block's first slot (as the drafter's contexts are); slots see them and each other by dflash_mask."""
        if block_embeds.dim() != 2:
            raise ValueError(f"block_embeds must be [B, {self.config.hidden_size}], got {tuple(block_embeds.shape)}")
        return self.forward_blocks(block_embeds[None], block_positions[None], [context])[0]

    def forward_blocks(
        self, block_embeds: Tensor, block_positions: Tensor, contexts: Sequence[list[tuple[Tensor, Tensor]]]
    ) -> Tensor:
        """S draft blocks at once (one per sequence): block_embeds [S, B, H], block_positions [S, B],
        contexts[s] = sequence s's per-layer (K, V) [n_s, kvh, hd] (or [] for none) -> hidden [S, B, H]."""
        cfg = self.config
        if block_embeds.dim() != 3 or block_embeds.shape[2] != cfg.hidden_size:
            raise ValueError(f"block_embeds must be [S, B, {cfg.hidden_size}], got {tuple(block_embeds.shape)}")
        S, b = block_embeds.shape[:2]
        if block_positions.shape != (S, b):
            raise ValueError(f"block_positions must be [{S}, {b}], got {tuple(block_positions.shape)}")
        if len(contexts) != S:
            raise ValueError(f"{len(contexts)} contexts for {S} blocks")
        empty = block_embeds.new_zeros(0, cfg.num_key_value_heads, cfg.head_dim, device=self.device)
        per_layer: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]  # [layer][block] -> (K, V)
        for s, context in enumerate(contexts):
            if context and len(context) != len(self.layers):
                raise ValueError(f"contexts[{s}] has {len(context)} layers, the drafter has {len(self.layers)}")
            for i in range(len(self.layers)):
                per_layer[i].append(context[i] if context else (empty, empty))
        h = block_embeds.reshape(S * b, cfg.hidden_size).to(self.device, self.dtype)
        cos, sin = self.cos_sin(block_positions.reshape(S * b).to(self.device))
        masks = self._block_masks(block_positions.to(self.device), [c[0].shape[0] for c in per_layer[0]])
        for i, (layer, ctx) in enumerate(zip(self.layers, per_layer)):
            h = layer(h, cos, sin, ctx, masks[cfg.layer_window(i)])
        return self.norm(h).view(S, b, cfg.hidden_size)

    def _block_masks(self, block_positions: Tensor, lengths: list[int]) -> dict[int, list[Tensor] | None]:
        """Per distinct layer window: each block's mask (None where nothing is hidden). Block s's context
        rows sit at the lengths[s] positions just before its first slot (a draft context ends at the root)."""
        cfg, out = self.config, {}
        for w in {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}:
            if not needs_mask(cfg.causal_head, w):
                out[w] = None
                continue
            out[w] = [
                block_mask(q, q[0] - n + torch.arange(n, device=q.device), cfg.causal_head, w)
                for q, n in zip(block_positions, lengths)
            ]
        return out

    def compute_logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """hidden [n, H], target lm_head weight [V, H] -> fp32 logits [n, V] (z-lab output extras)."""
        logits = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.T).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits
