"""DeepSeek-V3 / Kimi-K2 causal LM in plain torch, named like the HF checkpoint so that
`model.state_dict()` keys == saved keys (routed experts are stacked but named per expert, as on the hub).

The forward works on a flattened batch of new tokens from several sequences (see attention.py) and a
latent KV cache `kv_cache [num_layers, num_slots, kv_lora_rank + qk_rope_head_dim]` in the model dtype:
for each layer it writes the new tokens' [c_kv ; k_pe] at `meta.write_slots`, then attends.

The residual stream is carried between layers apart from the layer outputs (vLLM / SGLang): a layer takes
(h, residual) and returns its MLP output and the residual before it, so every norm after the first is a
fused residual add + RMSNorm (norm.add_rms_norm; one launch with the Triton layer kernels), the final
norm included. The sums are the same additions in the same order as `x = x + h`, so the numbers are too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.mla import DeepseekV3Attention
from ddtree.models.deepseek_v3.moe import DeepseekV3MLP, DeepseekV3MoE
from ddtree.models.layers.attention import AttentionMetadata, MLAAttentionBackend, make_attention_backend
from ddtree.models.layers.device_linear import route_linears
from ddtree.models.layers.layer_kernels import TORCH_KERNELS, LayerKernels, make_layer_kernels
from ddtree.models.layers.norm import RMSNorm
from ddtree.models.layers.rope import PositionRope, RotaryEmbedding


@dataclass(frozen=True, eq=False)
class ForwardOutput:
    logits: torch.Tensor | None  # fp32 [R, vocab] for the requested rows (tensor parallel: None unless gathered)
    taps: torch.Tensor | None  # [T, len(tap_layer_ids) * hidden] model dtype, pre-final-norm layer outputs
    argmax: torch.Tensor | None = None  # int64 [R]; set by the tensor-parallel forward (parallel/tp_model.py)
    hidden: torch.Tensor | None = None  # [R, d] final-normed rows, instead of logits (forward(hidden_only=True))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DeepseekV3Attention(config)
        if config.is_moe_layer(layer_idx):
            self.mlp: nn.Module = DeepseekV3MoE(config)
        else:
            self.mlp = DeepseekV3MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tp = None  # a parallel.TPGroup under tensor parallelism: attention and MLP give partial sums

    def forward(
        self, h, residual, positions, meta, kv_layer, backend, rope, kernels: LayerKernels = TORCH_KERNELS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) [T, d] -> (this layer's MLP output, residual before it); the layer's output is their
        sum. The first layer takes (embeddings, None)."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = h, kernels.rms_norm(h, norm.weight, norm.eps)
        else:
            x, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn(x, positions, meta, kv_layer, backend, rope, kernels)
        h = h if self.tp is None else self.tp.all_reduce(h)
        norm = self.post_attention_layernorm
        x, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.mlp(x, kernels)
        return (h if self.tp is None else self.tp.all_reduce(h)), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.qk_rope_head_dim)  # no weights


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: DeepseekV3Config,
        attention_backend: str | MLAAttentionBackend = "torch",
        kernels: str | None = None,
    ):
        """kernels: the decoder layers' small ops, "torch" | "triton" (layer_kernels.py); None = the attention
        backend's name ("triton" on CUDA, "torch" on the CPU). Chosen here once; `layer_kernels` may be
        replaced before a forward (e.g. make_layer_kernels("triton") on a CPU under TRITON_INTERPRET=1)."""
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attn_backend = (
            make_attention_backend(attention_backend) if isinstance(attention_backend, str) else attention_backend
        )
        if kernels is None:
            kernels = "triton" if self.attn_backend.name == "triton" else "torch"
        self.layer_kernels = make_layer_kernels(kernels)

    def route_to_kernels(self) -> None:
        """The linears and the INT4 experts' word order follow `layer_kernels` (layers/device_linear.py), once
        per choice: the forward calls it, after the weights are loaded; a caller that counts or times one
        forward calls it first, so that the one-time rewrite is not in the count."""
        device_gemms = self.layer_kernels.head_gemm is not None
        if self.__dict__.get("_device_gemms") != device_gemms:
            route_linears(self, device_gemms)
            self.__dict__["_device_gemms"] = device_gemms

    # ---- helpers shared with the drafter -----------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, d] model dtype
        return self.model.embed_tokens(input_ids)

    def new_kv_cache(self, num_slots: int, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """Zeroed latent cache [num_layers, num_slots, kv_cache_width] (model dtype/device by default)."""
        c = self.config
        return torch.zeros(
            c.num_hidden_layers, num_slots, c.kv_cache_width, dtype=dtype or self.dtype, device=device or self.device
        )

    # ---- forward -----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, num_slots, kv_cache_width], written in place
        logits_rows: torch.Tensor | None = None,  # int64 [R]; None = all T rows
        tap_layer_ids: tuple[int, ...] = (),
        hidden_only: bool = False,  # return the final-normed rows (ForwardOutput.hidden), no LM head
    ) -> ForwardOutput:
        c = self.config
        T = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape != (T,):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} / positions {tuple(positions.shape)} must be [T]")
        if meta.num_tokens != T:
            raise ValueError(f"metadata covers {meta.num_tokens} tokens, input_ids has {T}")
        if kv_cache.dim() != 3 or kv_cache.shape[0] != c.num_hidden_layers or kv_cache.shape[2] != c.kv_cache_width:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} must be [{c.num_hidden_layers}, num_slots, {c.kv_cache_width}]"
            )
        for i in tap_layer_ids:
            if not 0 <= i < c.num_hidden_layers:
                raise ValueError(f"tap layer id {i} not in [0, {c.num_hidden_layers})")

        h, residual = self.embed(input_ids), None  # [T, d]
        rope = PositionRope(self.model.rotary_emb, positions)  # cos/sin once for every layer
        kernels = self.layer_kernels
        self.route_to_kernels()
        taps: dict[int, torch.Tensor] = {}
        wanted = set(tap_layer_ids)
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, positions, meta, kv_cache[i], self.attn_backend, rope, kernels)
            if i in wanted:
                taps[i] = residual + h  # the layer's output
        if residual is not None and logits_rows is not None:
            h, residual = h[logits_rows], residual[logits_rows]  # [R, d]
        norm = self.model.norm
        if residual is None:  # no layers
            hidden = kernels.rms_norm(h if logits_rows is None else h[logits_rows], norm.weight, norm.eps)
        else:
            hidden = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)[0]  # [R, d]
        tap = torch.cat([taps[i] for i in tap_layer_ids], dim=-1) if tap_layer_ids else None
        if hidden_only:
            return ForwardOutput(logits=None, taps=tap, hidden=hidden)
        return ForwardOutput(logits=self.compute_logits(hidden), taps=tap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed rows [R, d] -> fp32 logits [R, vocab]."""
        return self.lm_head(hidden).float()
