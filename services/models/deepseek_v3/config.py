"""DeepSeek-V3 / Kimi-K2 model configuration, read from a Hugging Face `config.json`.

One frozen dataclass holds every architecture field the engine uses. `from_dict` accepts the spellings
found in the wild (docs/design.md §5):

- RoPE: legacy `rope_theta` + `rope_scaling{type|rope_type, factor, ...}` (hub checkpoints), or
  `rope_parameters{rope_type, rope_theta, ...}` (what transformers 5.x `save_pretrained` writes).
- `head_dim` in an HF-saved config is the RoPE width (qk_rope_head_dim), NOT the attention head size;
  it is ignored here. The query/key head size is `qk_head_dim = qk_nope_head_dim + qk_rope_head_dim`.
- `model_type` deepseek_v3 / kimi_k2, or kimi_k25 whose text model sits in `text_config`.
- `eos_token_id` may be an int or a list; it is kept as the tuple `eos_token_ids`.
- `quantization_config` describes how the weights are stored, not the architecture: it is ignored here
  and read by the loader (loader.py, quantization/), which dequantizes at load.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
WRAPPER_MODEL_TYPES = ("kimi_k25",)  # multimodal wrappers: the text model is in `text_config`
ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction m(f) = 0.1·mscale·ln(f) + 1 (1.0 when f <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters. For rope_type "default" only `theta` matters."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # explicit cos/sin factor; None = derive from mscales
    truncate: bool = True  # floor/ceil the YaRN correction range (HF default)

    @property
    def is_yarn(self) -> bool:
        return self.rope_type == "yarn"


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None = plain q_proj (V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    max_position_embeddings: int
    rope: RopeConfig
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_layer_freq: int = 1  # kept for round-trips; HF (and we) ignore it
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers (skipped on load)
    initializer_range: float = 0.02
    model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the naive form: dn + dr."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Per-token, per-layer latent cache width: r (normalised c_kv) + dr (rotated k_pe)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 · m², m = yarn_get_mscale(factor, mscale_all_dim) (HF yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.is_yarn and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def eos_token_id(self) -> int | None:
        """First EOS id (convenience); all stop ids are in `eos_token_ids`."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        if not 0 <= layer_idx < self.num_hidden_layers:
            raise ValueError(f"layer_idx {layer_idx} out of range [0, {self.num_hidden_layers})")
        return layer_idx >= self.first_k_dense_replace

    # ---- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeepseekV3Config:
        d = dict(d)
        model_type = d.get("model_type", "deepseek_v3")
        if model_type in WRAPPER_MODEL_TYPES or ("text_config" in d and model_type not in TEXT_MODEL_TYPES):
            if "text_config" not in d:
                raise ValueError(f"model_type {model_type!r} needs a 'text_config' with the text model")
            return cls.from_dict(d["text_config"])
        if model_type not in TEXT_MODEL_TYPES:
            raise ValueError(
                f"model_type: {model_type!r} is not supported; expected one of {TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES}"
            )
        heads = _req(d, "num_attention_heads")
        kv_heads = d.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ValueError(f"num_key_value_heads: {kv_heads} must equal num_attention_heads ({heads}) for MLA")
        eos = d.get("eos_token_id", 1)
        eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),))
        return cls(
            vocab_size=_req(d, "vocab_size"),
            hidden_size=_req(d, "hidden_size"),
            intermediate_size=_req(d, "intermediate_size"),
            moe_intermediate_size=_req(d, "moe_intermediate_size"),
            num_hidden_layers=_req(d, "num_hidden_layers"),
            num_attention_heads=heads,
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=_req(d, "kv_lora_rank"),
            qk_nope_head_dim=_req(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_req(d, "qk_rope_head_dim"),
            v_head_dim=_req(d, "v_head_dim"),
            n_routed_experts=_req(d, "n_routed_experts"),
            num_experts_per_tok=_req(d, "num_experts_per_tok"),
            n_shared_experts=d.get("n_shared_experts") or 0,
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            max_position_embeddings=_req(d, "max_position_embeddings"),
            rope=_parse_rope(d),
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            scoring_func=d.get("scoring_func", "sigmoid"),
            topk_method=d.get("topk_method", "noaux_tc"),
            moe_layer_freq=d.get("moe_layer_freq", 1),
            hidden_act=d.get("hidden_act", "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_interleave=bool(d.get("rope_interleave", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0,
            initializer_range=float(d.get("initializer_range", 0.02)),
            model_type=model_type,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DeepseekV3Config:
        """Read `<dir>/config.json` (or a config.json path)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        with open(p) as f:
            return cls.from_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """HF-style config.json content, with the legacy `rope_theta` + `rope_scaling` keys."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            # transformers has no kimi_k2 config class; the architecture is deepseek_v3
            "model_type": "deepseek_v3",
        }
        skip = {"rope", "eos_token_ids", "model_type"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                out[f.name] = getattr(self, f.name)
        out["num_key_value_heads"] = self.num_attention_heads
        ids = self.eos_token_ids
        out["eos_token_id"] = None if not ids else (ids[0] if len(ids) == 1 else list(ids))
        out["rope_theta"] = self.rope.theta
        if self.rope.is_yarn:
            scaling = {
                "type": "yarn",
                "factor": self.rope.factor,
                "beta_fast": self.rope.beta_fast,
                "beta_slow": self.rope.beta_slow,
                "mscale": self.rope.mscale,
                "mscale_all_dim": self.rope.mscale_all_dim,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            }
            if self.rope.attention_factor is not None:
                scaling["attention_factor"] = self.rope.attention_factor
            if not self.rope.truncate:
                scaling["truncate"] = False
            out["rope_scaling"] = scaling
        else:
            out["rope_scaling"] = None
        return out


def _req(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{key}: missing from config")
    return d[key]


def _parse_rope(d: Mapping[str, Any]) -> RopeConfig:
    """Both spellings: `rope_parameters` (theta inside) or legacy `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters")
    if params is not None:
        params = dict(params)
        theta = params.pop("rope_theta", d.get("rope_theta"))
    else:
        params = dict(d.get("rope_scaling") or {})
        theta = d.get("rope_theta")
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type: {rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("rope_scaling.original_max_position_embeddings: required for yarn")
    factor = params.get("factor")
    if factor is None:  # HF: derive from the context extension ratio
        factor = _req(d, "max_position_embeddings") / orig
    opt = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        beta_fast=float(params.get("beta_fast") or 32.0),  # HF: `or 32`
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        original_max_position_embeddings=int(orig),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _validate(c: DeepseekV3Config) -> None:
    def positive(name: str) -> None:
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}: must be a positive int, got {v!r}")

    for name in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "max_position_embeddings", "n_group", "topk_group",
    ):  # fmt: skip
        positive(name)
    if c.q_lora_rank is not None:
        positive("q_lora_rank")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim: must be even (rotated in pairs), got {c.qk_rope_head_dim}")
    if not isinstance(c.n_shared_experts, int) or c.n_shared_experts < 0:
        raise ValueError(f"n_shared_experts: must be an int >= 0, got {c.n_shared_experts!r}")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        raise ValueError(f"first_k_dense_replace: {c.first_k_dense_replace} not in [0, {c.num_hidden_layers}]")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(f"num_experts_per_tok: {c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}")
    if c.n_routed_experts % c.n_group:
        raise ValueError(f"n_group: {c.n_group} does not divide n_routed_experts {c.n_routed_experts}")
    per_group = c.n_routed_experts // c.n_group
    if per_group < 2:
        raise ValueError(f"n_group: {c.n_group} leaves < 2 experts per group (group score = top-2 sum)")
    if c.topk_group > c.n_group:
        raise ValueError(f"topk_group: {c.topk_group} > n_group {c.n_group}")
    if c.num_experts_per_tok > c.topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok: {c.num_experts_per_tok} > experts reachable in topk_group groups "
            f"({c.topk_group * per_group})"
        )
    if c.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func: {c.scoring_func!r} is not supported; expected 'sigmoid'")
    if c.topk_method != "noaux_tc":
        raise ValueError(f"topk_method: {c.topk_method!r} is not supported; expected 'noaux_tc'")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act: {c.hidden_act!r} is not supported; expected 'silu'")
    if not c.rope_interleave:
        raise ValueError("rope_interleave: False is not supported; checkpoints use interleaved pairs")
    if c.tie_word_embeddings:
        raise ValueError("tie_word_embeddings: True is not supported; DeepSeek/Kimi keep lm_head separate")
    if not c.rms_norm_eps > 0:
        raise ValueError(f"rms_norm_eps: must be > 0, got {c.rms_norm_eps}")
    if c.rope.theta <= 0:
        raise ValueError(f"rope_theta: must be > 0, got {c.rope.theta}")
    if c.rope.is_yarn:
        if c.rope.factor <= 0:
            raise ValueError(f"rope_scaling.factor: must be > 0, got {c.rope.factor}")
        if not c.rope.original_max_position_embeddings or c.rope.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings: must be a positive int")
    if not isinstance(c.eos_token_ids, tuple):
        raise ValueError(f"eos_token_ids: must be a tuple of ints, got {c.eos_token_ids!r}")
    for name in ("bos_token_id", "pad_token_id"):
        v = getattr(c, name)
        if v is not None and not 0 <= v < c.vocab_size:
            raise ValueError(f"{name}: {v} not in [0, vocab_size {c.vocab_size})")
    for e in c.eos_token_ids:
        if not 0 <= e < c.vocab_size:
            raise ValueError(f"eos_token_id: {e} not in [0, vocab_size {c.vocab_size})")
