"""DFlash block-diffusion drafter (ddtree.md §1): Qwen3-style layers under checkpoint weight names.

The drafter has no embedding table and no LM head: the caller embeds the block with the TARGET's
`embed_tokens` and projects hidden states with the TARGET's `lm_head` (compute_logits).

Per committed token, the target's tapped residual-stream features [len(ids) * H_t] are fused once
(fc -> hidden_norm), and every layer turns that same fused feature into context K/V (k_proj, k_norm,
RoPE at the token's absolute position; v_proj). Context features are never queries and are not
updated from layer to layer, so their K/V are computed once and cached (context_kv). A draft block
[anchor, MASK x (B-1)] then runs through the layers as queries that attend, without a mask, to
[context K/V ; block K/V] (forward_block).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab default (ddtree.md §1.2): [L//2] for one draft layer, else n ids spread over 1..L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # yarn; None = max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_dict(d: Mapping[str, Any] | None) -> RopeScaling:
        if not d:
            return RopeScaling()
        kind = d.get("rope_type", d.get("type")) or "default"
        if kind not in ("default", "linear", "yarn"):
            raise ValueError(f"config.json: unsupported rope_scaling type {kind!r} (default, linear, yarn)")
        if kind == "default":
            return RopeScaling()
        return RopeScaling(
            rope_type=kind,
            factor=float(d.get("factor", 1.0)),
            original_max_position_embeddings=d.get("original_max_position_embeddings"),
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            mscale=d.get("mscale"),
            mscale_all_dim=d.get("mscale_all_dim"),
            attention_factor=d.get("attention_factor"),
            truncate=bool(d.get("truncate", True)),
        )


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    input_embedding_scale: float = 1.0  # dflash_config extras (z-lab); applied by the caller
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def feature_size(self) -> int:
        """Width of one committed token's target features: len(target_layer_ids) * target_hidden_size."""
        return len(self.target_layer_ids) * self.target_hidden_size

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "block_size",
            "target_hidden_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"DFlashConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2 (anchor + one mask), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DFlashConfig.num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DFlashConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} not in [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("DFlashConfig.target_layer_ids is empty")
        top = self.num_target_layers
        for i in self.target_layer_ids:
            if i < 0 or (top is not None and i >= top):
                raise ValueError(
                    f"DFlashConfig.target_layer_ids {list(self.target_layer_ids)}: id {i} "
                    f"outside [0, num_target_layers={top})"
                )

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DFlashConfig:
        """Parse a DFlash-format config.json (ddtree.md §1.5); dflash_config{} overrides top level."""
        extra = d.get("dflash_config") or {}

        def get(name: str, default: Any = KeyError) -> Any:
            value = extra.get(name, d.get(name))
            if value is None:
                if default is KeyError:
                    raise ValueError(f"config.json: missing required field {name!r}")
                return default
            return value

        layer_types = d.get("layer_types") or ()
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.json: only full_attention drafter layers are supported, got {list(layer_types)}")
        num_layers = int(get("num_hidden_layers"))
        num_target_layers = get("num_target_layers", None)
        ids = get("target_layer_ids", None)
        if ids is None:
            if num_target_layers is None:
                raise ValueError("config.json: needs dflash_config.target_layer_ids or num_target_layers")
            ids = default_target_layer_ids(int(num_target_layers), num_layers)
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        softcap = get("final_logit_softcapping", None)
        rope = d.get("rope_parameters") or {}  # transformers >= 5 layout: theta + scaling in one dict
        cfg = DFlashConfig(
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            vocab_size=int(get("vocab_size")),
            block_size=int(get("block_size", 16)),
            mask_token_id=int(get("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in ids),
            target_hidden_size=int(get("target_hidden_size", hidden)),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_dict(d.get("rope_scaling") or rope),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            attention_bias=bool(get("attention_bias", False)),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """DFlash-format config.json content."""
        extra: dict[str, Any] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for name, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if getattr(self, name) != default:
                extra[name] = getattr(self, name)
        scaling = None
        if self.rope_scaling.rope_type != "default":
            scaling = {k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": extra,
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
        }


def rope_inv_freq(cfg: DFlashConfig) -> tuple[Tensor, float]:
    """(inv_freq fp32 [head_dim/2], cos/sin scale) as HF's ROPE_INIT_FUNCTIONS default/linear/yarn."""
    dim, base, rs = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu", dtype=torch.float32) / dim)  # [dim/2]
    if rs.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rs.rope_type == "linear":
        return 1.0 / pos_freqs / rs.factor, 1.0
    # yarn: interpolate low frequencies, extrapolate high ones, linear ramp in between
    orig = rs.original_max_position_embeddings or cfg.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.attention_factor
    if attn is None:
        attn = (
            mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim)
            if rs.mscale and rs.mscale_all_dim
            else mscale(rs.factor)
        )

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device="cpu", dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 = keep the original frequency
    inv_freq = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [n, heads, hd], cos/sin [n, hd] -> [n, heads, hd] (NEOX rotate-half, as Qwen3)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float) -> Tensor:
    """Unmasked grouped-query attention of one block over keys/values given in parts (the cached context,
    then the block's own): q [B, nh, hd], keys[j] / values[j] [n_j, kvh, hd] -> [B, nh, hd] (q's dtype).
    The result is attention over the parts' concatenation; the parts are never concatenated: scores are
    computed per part and joined ([kvh, B·g, sum n_j], small), and the weighted sum adds each part's share,
    so a long context is read in place, not copied at every layer of every draft.

    Query head h reads kv head h // (nh / kvh) (as repeat_interleave, or SDPA's enable_gqa). Scores,
    softmax and the weighted sum are fp32 whatever the model dtype (a part already in fp32 is read as is).
    Bmm over [kvh, B·g, n] rather than SDPA: for a few queries over a long context, CPU SDPA costs about
    3x more (the block is 8 rows, the context up to the window).
    """
    B, nh, hd = q.shape
    kvh = keys[0].shape[1]
    g = nh // kvh
    qg = q.view(B, kvh, g, hd).permute(1, 0, 2, 3).reshape(kvh, B * g, hd).float()  # [kvh, B*g, hd]
    scores = torch.cat([torch.bmm(qg, k.float().permute(1, 2, 0)) for k in keys], dim=-1) * scale  # [kvh, B*g, n]
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
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, contexts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """x [S*B, H] (S blocks of B slots, after input_layernorm), cos/sin [S*B, hd], contexts[s] = block s's
        context (K, V) [n_s, kvh, hd] -> [S*B, H]. Block s sees its own context and its own B slots; no mask.

        Projections run over all S*B rows at once; the attention core runs per block, since contexts differ
        in length (grouped_attention per block; padding every block to the longest context measured slower:
        the padded copies cost more than the calls they save)."""
        rows, nh, hd = x.shape[0], self.num_heads, self.head_dim
        b = rows // len(contexts)
        q = apply_rope(self.q_norm(self.q_proj(x).view(rows, nh, hd)), cos, sin)  # [S*B, nh, hd]
        k, v = self.kv(x, cos, sin)  # [S*B, kvh, hd]
        out = torch.empty_like(q)
        for s, (ctx_k, ctx_v) in enumerate(contexts):
            blk = slice(s * b, (s + 1) * b)  # keys: the context [n_s], then the block's own B slots
            out[blk] = grouped_attention(q[blk], (ctx_k, k[blk]), (ctx_v, v[blk]), hd**-0.5)
        return self.o_proj(out.reshape(rows, nh * hd))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, contexts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, contexts)
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
        self._inv_freq, self._rope_scale = rope_inv_freq(cfg)  # plain CPU fp32 tensor, not a weight

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [n] -> cos, sin [n, hd] in the model dtype (computed in fp32, as HF)."""
        inv = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]  # [n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, hd]
        return (emb.cos() * self._rope_scale).to(self.dtype), (emb.sin() * self._rope_scale).to(self.dtype)

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """features [n, len(ids) * H_t], positions [n] (absolute) -> per layer (K, V) [n, kvh, hd]."""
        n = features.shape[0]
        if features.dim() != 2 or features.shape[1] != self.config.feature_size:
            raise ValueError(f"features must be [n, {self.config.feature_size}], got {tuple(features.shape)}")
        if positions.shape != (n,):
            raise ValueError(f"positions must be [{n}], got {tuple(positions.shape)}")
        ctx = self.hidden_norm(self.fc(features.to(self.device, self.dtype)))  # [n, H]
        cos, sin = self._cos_sin(positions.to(self.device))
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward_block(
        self, block_embeds: Tensor, block_positions: Tensor, context: list[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """block_embeds [B, H], block_positions [B], context per layer (K, V) [n, kvh, hd] (or [] for
        none) -> hidden [B, H] after the final norm. Every block slot sees all context and all slots."""
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
        cos, sin = self._cos_sin(block_positions.reshape(S * b).to(self.device))
        for layer, ctx in zip(self.layers, per_layer):
            h = layer(h, cos, sin, ctx)
        return self.norm(h).view(S, b, cfg.hidden_size)

    def compute_logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """hidden [n, H], target lm_head weight [V, H] -> fp32 logits [n, V] (z-lab output extras)."""
        logits = (hidden.to(lm_head_weight.dtype) @ lm_head_weight.T).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _read_state(path: Path) -> dict[str, Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    state: dict[str, Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k in state:
                raise ValueError(f"{path}: key {k!r} appears in more than one safetensors file")
            state[k] = v
    return state


def load_drafter(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> DFlashDraftModel:
    """Load config.json + *.safetensors. Strict: every missing, unexpected or misshapen key is named.

    dtype None = the checkpoint's fc.weight dtype (all weights are cast to one dtype).
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json")
    cfg = DFlashConfig.from_dict(json.loads(cfg_file.read_text()))
    state = _read_state(path)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = [
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in sorted(set(expected) & set(state))
        if tuple(state[k].shape) != expected[k]
    ]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{path}: drafter weights do not match config.json: missing keys {missing}; "
            f"unexpected keys {unexpected}; shape mismatches {misshapen}"
        )
    dtype = dtype or state["fc.weight"].dtype
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def write_random_drafter(
    path: str | Path,
    target: Mapping[str, Any],
    seed: int = 0,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    rope_theta: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a reproducible random drafter for `target` (a target config.json dict, or just
    {hidden_size, num_hidden_layers, vocab_size}) to path/{config.json, model.safetensors}.

    Defaults: mask token = vocab_size - 1; taps = the z-lab default ids when they are distinct and in
    range for this target (they are not for targets under ~6 layers), else ids spread over all layers.
    """
    path = Path(path)
    hidden, num_target, vocab = int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])
    if target_layer_ids is None:
        ids = default_target_layer_ids(num_target, num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_target:
            m = min(num_layers, num_target)
            ids = tuple(sorted({round(i * (num_target - 1) / max(m - 1, 1)) for i in range(m)}))
        target_layer_ids = ids
    cfg = DFlashConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden // num_attention_heads,
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids),
        target_hidden_size=hidden,
        num_target_layers=num_target,
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or target.get("rope_theta", 10000.0)),
        max_position_embeddings=int(target.get("max_position_embeddings", 32768)),
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DFlashDraftModel(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 2:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:  # biases
            w = 0.02 * torch.randn(shape, generator=gen)
        state[name] = w.to(dtype).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
