"""Multi-head Latent Attention (MLA), absorbed form over a latent cache (docs/design.md §5).

Shapes: T new tokens, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
r = kv_lora_rank. kv_b_proj.weight [H·(dn+dv), r] viewed as [H, dn+dv, r] gives
W_UK = [:, :dn, :] and W_UV = [:, dn:, :].

Every forward (prefill, decode, tree verify) uses the absorbed form:
  0. [q_a ; latent ; k_pe] = fused_qkv_a_proj_with_mqa(h): q_a_proj and kv_a_proj_with_mqa read the same h,
     so they are one GEMM [q_lora_rank + r + dr, d] (merged_linear.py; the state dict still shows both, as
     views; a quantized checkpoint whose blocks do not allow it keeps two GEMMs, see pack_modules)
  1. q = q_b_proj(q_a_layernorm(q_a))  (or q_proj(h)) -> [T, H, dn+dr] = [q_nope ; q_pe]
  2. c_kv = kv_a_layernorm(latent)
  3. rotate q_pe and k_pe at the tokens' positions; write [c_kv ; k_pe] into kv_layer[write_slots]
  4. q_lat = W_UKᵀ q_nope  [T, H, r];  o_lat = backend.attend(q_lat, q_pe, kv_layer)  [T, H, r]
  5. o = W_UV o_lat  [T, H, dv] -> o_proj

`naive_mla` below is the textbook (non-absorbed) form, kept only to document and test what the
absorbed form computes.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.layers.attention import AttentionMetadata, MLAAttentionBackend
from ddtree.models.layers.layer_kernels import TORCH_KERNELS, LayerKernels
from ddtree.models.layers.merged_linear import is_merged, register_merged
from ddtree.models.layers.norm import RMSNorm
from ddtree.models.layers.packed_linear import dense_weight
from ddtree.models.layers.rope import RotaryEmbedding

A_LAYERNORM_EPS = 1e-6  # HF and Moonshot build q_a/kv_a layernorms with the default eps, ignoring rms_norm_eps


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.num_heads = H = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        d, qk = config.hidden_size, config.qk_head_dim
        bias = config.attention_bias
        kv_a = config.kv_lora_rank + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(d, kv_a, bias=bias)
        else:
            self.fused_qkv_a_proj_with_mqa = nn.Linear(d, config.q_lora_rank + kv_a, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=A_LAYERNORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        register_merged(
            self,
            {"fused_qkv_a_proj_with_mqa": (("q_a_proj", config.q_lora_rank), ("kv_a_proj_with_mqa", kv_a))}
            if config.q_lora_rank is not None else {},
            ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
             "o_proj"),
        )  # fmt: skip
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=A_LAYERNORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * config.v_head_dim, d, bias=bias)

    # ---- shared projections ----------------------------------------------------------------------
    def project_a(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """h [T, d] -> (q_a [T, q_lora_rank], None without q_lora_rank; kv_a output [T, r+dr] = [c_kv ; k_pe],
        neither normalised nor rotated). One GEMM when merged: both are column views of its output."""
        if self.q_lora_rank is None:
            return None, self.kv_a_proj_with_mqa(h)
        if is_merged(self, "fused_qkv_a_proj_with_mqa"):
            return self.fused_qkv_a_proj_with_mqa(h).split([self.q_lora_rank, self.kv_cache_width], dim=-1)
        return self.q_a_proj(h), self.kv_a_proj_with_mqa(h)

    def project_q(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        q_a: torch.Tensor | None = None,  # project_a's, when the caller has it
        kernels: LayerKernels = TORCH_KERNELS,
    ):
        """h [T, d] -> q_nope [T, H, dn], rotated q_pe [T, H, dr]."""
        if self.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q_a = self.project_a(h)[0] if q_a is None else q_a
            q = self.q_b_proj(kernels.rms_norm(q_a, self.q_a_layernorm.weight, self.q_a_layernorm.eps))
        q = q.view(h.shape[0], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if kernels.rope_q is not None and getattr(rope, "positions", None) is positions:  # the forward's tables
            return q_nope, kernels.rope_q(q_pe, rope.cos, rope.sin)
        return q_nope, rope(q_pe, positions)

    def project_latent(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """h [T, d] -> cache rows [T, r+dr] = [normalised c_kv ; rotated k_pe]."""
        latent, k_pe = self.project_a(h)[1].split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(latent), rope(k_pe, positions)], dim=-1)

    @property
    def kv_cache_width(self) -> int:  # r + dr
        return self.kv_lora_rank + self.qk_rope_head_dim

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, r], W_UV [H, dv, r] (views of kv_b_proj.weight, or of its dense copy)."""
        w = self._kv_b_dense()
        w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _kv_b_dense(self) -> torch.Tensor:
        """kv_b_proj's weight [H·(dn+dv), r]. A packed (FP8) kv_b_proj is dequantized once, in the dtype of
        the model's other weights, and the copy kept beside the packed tensors (not in the state dict; made
        again when they change, e.g. filled in place by the loader or moved): DeepSeek-V3 at TP 8 holds
        16 heads x 256 x 512 per layer, 4 MiB in bf16, so 61 layers cost 0.24 GiB a rank and no forward
        dequantizes it again."""
        linear = self.kv_b_proj
        if isinstance(linear, nn.Linear):
            return linear.weight
        dtype = self.kv_a_layernorm.weight.dtype
        tensors = [*linear.parameters(recurse=False), *linear.buffers(recurse=False)]
        key = (dtype, *((t.device, t.data_ptr(), t._version) for t in tensors))
        cached = self.__dict__.get("_kv_b_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, dense_weight(linear, dtype))
            self.__dict__["_kv_b_cache"] = cached
        return cached[1]

    # ---- absorbed forward ------------------------------------------------------------------------
    def forward(
        self,
        h: torch.Tensor,  # [T, d] normalised hidden states of the new tokens
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,  # [S, r+dr] this layer's cache, written in place at meta.write_slots
        backend: MLAAttentionBackend,
        rope: RotaryEmbedding,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> torch.Tensor:  # [T, d]
        T = h.shape[0]
        q_a, latent = self.project_a(h)  # one GEMM when merged
        q_nope, q_pe = self.project_q(h, positions, rope, q_a, kernels)  # [T, H, dn], [T, H, dr]
        # [normalised c_kv ; rotated k_pe] into the cache: project_latent + scatter (fused on the triton backend)
        backend.write_latent(kv_layer, latent, meta.write_slots, positions, self.kv_a_layernorm, rope)
        w_uk, w_uv = self.w_uk_uv()
        # Both absorptions as one bmm over heads (what einsum "thn,hnr->thr" / "thr,hvr->thv" runs, the same
        # numbers, without its per-call planning ops)
        if kernels.head_gemm is not None:  # the device path: row invariant (kernels/gemm/dense.py)
            q_lat = kernels.head_gemm(q_nope, w_uk.transpose(1, 2))  # [T, H, r]
        else:
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        o_lat = backend.attend(q_lat, q_pe.to(q_lat.dtype), kv_layer, meta, self.softmax_scale)  # [T, H, r]
        if kernels.head_gemm is not None:
            o = kernels.head_gemm(o_lat.to(w_uv.dtype), w_uv)  # [T, H, dv]
        else:
            o = torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, dv]
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))


def naive_mla(
    attn: DeepseekV3Attention,
    h: torch.Tensor,  # [N, d] one sequence, no cache
    positions: torch.Tensor,  # int64 [N]
    visible: torch.Tensor,  # bool [N, N], True = query row may attend key column
    rope: RotaryEmbedding,
) -> torch.Tensor:  # [N, d]
    """Non-absorbed MLA (test-only reference): expand per-head k_nope and v through kv_b_proj.

    score_h(t,s) = ([q_nope_h ; q_pe_h](t) · [k_nope_h ; k_pe](s)) · scale with k_nope_h = W_UK[h] c_kv,
    which equals (W_UK[h]ᵀ q_nope_h)·c_kv + q_pe_h·k_pe: the absorbed score. Likewise
    o_h = Σ P·(W_UV[h] c_kv) = W_UV[h] (Σ P·c_kv).
    """
    N, H = h.shape[0], attn.num_heads
    dn, dv, r = attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    q_nope, q_pe = attn.project_q(h, positions, rope)  # [N, H, dn], [N, H, dr]
    lat = attn.project_latent(h, positions, rope)  # [N, r+dr]
    c_kv, k_pe = lat[:, :r], lat[:, r:]
    kv = attn.kv_b_proj(c_kv).view(N, H, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]  # [N, H, dn], [N, H, dv]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [N, H, dn+dr]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(N, H, k_pe.shape[-1])], dim=-1)  # [N, H, dn+dr]
    scores = torch.einsum("qhc,khc->hqk", q.float(), k.float()) * attn.softmax_scale  # [H, N, N]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    o = torch.einsum("hqk,khv->qhv", probs, v.float()).to(h.dtype)  # [N, H, dv]
    return attn.o_proj(o.reshape(N, H * dv))
