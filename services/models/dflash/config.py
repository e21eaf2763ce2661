"""The DFlash drafter's configuration, read from and written to its DFlash-format `config.json`.

The file is a Qwen3-style config (`model_type` qwen3, `architectures` ["DFlashDraftModel"]) plus the
drafter's own fields: `block_size`, `num_target_layers`, `target_hidden_size` and a `dflash_config{}`
section (`mask_token_id`, `target_layer_ids`, and the optional z-lab extras `input_embedding_scale`,
`output_multiplier`, `final_logit_softcapping`). A field in `dflash_config{}` overrides the same field at the
top level.

RoPE is read into the shared `RopeConfig` (the target's): theta from `rope_parameters.rope_theta` (the
transformers >= 5 layout) or `rope_theta`; scaling from `rope_scaling` or `rope_parameters`, of type
default, linear or yarn. Unlike the target's config, a yarn section may leave out
`original_max_position_embeddings` (HF then uses `max_position_embeddings`; the model resolves it) and a
missing `factor` is 1.0. Values are kept as written, so that `to_dict` writes back what it read.

The YaRN attention factor (the cos/sin multiplier; attention logits scale by its square) is
`rope_scaling.attention_factor` when given, the key transformers' YaRN (which HF Qwen3 uses) honours as an
override; else transformers' rule: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
set, else 1 + 0.1 ln(factor) (ATTENTION_FACTOR_HELP; computed by rope.rope_attention_factor).

Attention inside the draft block, and which slots carry predictions (models/dflash/mask.py has the rule):
- `dflash_config.causal_head` (JetSpec's causal parallel head; default false = DFlash's bidirectional
  block): block slot i sees the context and block slots j <= i.
- `dflash_config.draft_shift` (default false): false = in place, slot d (1..B-1) predicts depth d, the token
  at its own position (its input is a MASK); true = shifted, slot d (0..B-2) predicts depth d + 1, the next
  token (slot 0 holds the root, as always). Either way the block drafts depths 1..B-1. Only these two exist:
  a shift of 2 or more would never predict depth 1, a negative one would predict committed tokens; any
  other value is refused.
- Qwen3-style `layer_types` ("full_attention" | "sliding_attention" per layer; absent = derived as
  transformers' Qwen3Config does from `use_sliding_window` and `max_window_layers`) with `sliding_window` W:
  a sliding layer's query at position p sees keys at positions k with |p - k| < W (transformers' window
  p - k < W, symmetric inside a bidirectional block as flash-attention's non-causal window).
A config that asks for anything else is refused at load with one line naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddtree.models.deepseek_v3.config import RopeConfig

DRAFTER_ROPE_TYPES = ("default", "linear", "yarn")
ATTENTION_FACTOR_HELP = (
    "rope_scaling.attention_factor is the YaRN cos/sin factor (attention logits scale by its square); left out, "
    "it is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else 1 + 0.1 ln(factor), "
    "as in transformers; SGLang and vLLM <= 0.29 use 1 + 0.1 ln(factor) for plain YaRN whatever the mscales"
)
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope_scaling keys in the order `to_dict` writes them; None values are left out
_ROPE_SCALING_KEYS = (
    "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "attention_factor", "truncate",
)  # fmt: skip


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The z-lab default taps: [L // 2] for one draft layer, else n ids spread evenly over 1 .. L-3.

    These are the target layers whose outputs the drafter reads when a config names only
    `num_target_layers`. For targets under about 6 layers the ids can repeat or fall out of range.
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def parse_drafter_rope(scaling: Mapping[str, Any] | None, theta: float) -> RopeConfig:
    """RopeConfig from a drafter config's rope scaling section (None or {} = default RoPE) and rope_theta.

    Raises on a scaling type other than default, linear or yarn, and on an attention_factor that is not a
    positive number (the error says what the factor is). A "default" section keeps only theta.
    """
    if not scaling:
        return RopeConfig(theta=theta)
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in DRAFTER_ROPE_TYPES:
        raise ValueError(f"config.json: unsupported rope_scaling type {kind!r} (default, linear, yarn)")
    if kind == "default":
        return RopeConfig(theta=theta)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None and not (
        isinstance(attention_factor, int | float)
        and not isinstance(attention_factor, bool)
        and math.isfinite(attention_factor)
        and attention_factor > 0
    ):
        raise ValueError(
            f"config.json: rope_scaling.attention_factor must be a positive number, got {attention_factor!r} "
            f"({ATTENTION_FACTOR_HELP})"
        )
    return RopeConfig(
        theta=theta,
        rope_type=kind,
        factor=float(scaling.get("factor", 1.0)),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"),
        original_max_position_embeddings=scaling.get("original_max_position_embeddings"),  # None: max positions
        attention_factor=attention_factor,  # None: transformers' rule (rope.rope_attention_factor)
        truncate=bool(scaling.get("truncate", True)),
    )


@dataclass(frozen=True)
class DFlashConfig:
    """Architecture of one DFlash drafter: Qwen3-style layers of width hidden_size fed by the features of
    len(target_layer_ids) target layers (target_hidden_size wide each). No vocabulary weights of its own:
    vocab_size and mask_token_id name the target's embedding and LM head rows."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int  # draft block: the anchor + block_size - 1 mask slots
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    num_target_layers: int | None = None  # None = unknown (ids are then only checked to be >= 0)
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)  # yarn's original_max_position_embeddings may be None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    input_embedding_scale: float = 1.0  # dflash_config extras (z-lab); applied by the caller
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    causal_head: bool = False  # block slot i sees slots <= i (else every slot of its block)
    draft_shift: bool = False  # slot d predicts depth d + 1 (slots 0..B-2), else depth d (slots 1..B-1)
    layer_types: tuple[str, ...] = ()  # per layer full_attention | sliding_attention; () = all full
    sliding_window: int | None = None  # W of the sliding_attention layers

    @property
    def prediction_slots(self) -> slice:
        """The block slots whose hidden states predict depths 1..B-1, in depth order."""
        return slice(0, self.block_size - 1) if self.draft_shift else slice(1, self.block_size)

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window W (0 = full attention)."""
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return int(self.sliding_window or 0)
        return 0

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
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"config.json: layer_types has {len(self.layer_types)} entries for "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"config.json: layer_types {bad} not supported (full_attention, sliding_attention)")
            if "sliding_attention" in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= 1
            ):
                raise ValueError(
                    f"config.json: sliding_window must be a positive integer for sliding_attention layers, "
                    f"got {self.sliding_window!r}"
                )
        top = self.num_target_layers
        for i in self.target_layer_ids:
            if i < 0 or (top is not None and i >= top):
                raise ValueError(
                    f"DFlashConfig.target_layer_ids {list(self.target_layer_ids)}: id {i} "
                    f"outside [0, num_target_layers={top})"
                )

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DFlashConfig:
        """Parse a DFlash-format config.json; dflash_config{} overrides the top level. Validated."""
        extra = d.get("dflash_config") or {}

        def get(name: str, default: Any = KeyError) -> Any:
            value = extra.get(name, d.get(name))
            if value is None:
                if default is KeyError:
                    raise ValueError(f"config.json: missing required field {name!r}")
                return default
            return value

        num_layers = int(get("num_hidden_layers"))
        layer_types, sliding_window = _layer_types(d, num_layers)
        num_target_layers = get("num_target_layers", None)
        ids = get("target_layer_ids", None)
        if ids is None:
            if num_target_layers is None:
                raise ValueError("config.json: needs dflash_config.target_layer_ids or num_target_layers")
            ids = default_target_layer_ids(int(num_target_layers), num_layers)
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        softcap = get("final_logit_softcapping", None)
        params = d.get("rope_parameters") or {}  # transformers >= 5 layout: theta + scaling in one dict
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
            rope=parse_drafter_rope(
                d.get("rope_scaling") or params, float(params.get("rope_theta") or get("rope_theta", 10000.0))
            ),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            attention_bias=bool(get("attention_bias", False)),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            output_multiplier=float(get("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            causal_head=_flag(extra, d, "causal_head"),
            draft_shift=_flag(extra, d, "draft_shift"),
            layer_types=layer_types,
            sliding_window=sliding_window,
        )
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """DFlash-format config.json content (legacy `rope_theta` + `rope_scaling` keys)."""
        extra: dict[str, Any] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for name, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if getattr(self, name) != default:
                extra[name] = getattr(self, name)
        if self.causal_head:
            extra["causal_head"] = True
        if self.draft_shift:
            extra["draft_shift"] = True
        windows: dict[str, Any] = {}
        if self.layer_types:
            windows = {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window}
        scaling = None
        if self.rope.rope_type != "default":
            values = {k: getattr(self.rope, k) for k in _ROPE_SCALING_KEYS}
            scaling = {k: v for k, v in values.items() if v is not None}
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
            "rope_theta": self.rope.theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            **windows,
        }


def _flag(extra: Mapping[str, Any], d: Mapping[str, Any], name: str) -> bool:
    """A boolean dflash_config field (dflash_config{} over the top level); true / false, or 1 / 0."""
    value = extra.get(name, d.get(name))
    if value is None:
        return False
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"config.json: dflash_config.{name} must be true or false, got {value!r}")


def _layer_types(d: Mapping[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config reads them: `layer_types` as written, else
    sliding_attention from layer max_window_layers on where `use_sliding_window` is set, else all full.
    A config without sliding layers comes back as ((), None), so that it compares equal to one without
    the fields."""
    types = d.get("layer_types")
    window = d.get("sliding_window")
    if types is None and d.get("use_sliding_window"):
        first = d.get("max_window_layers")
        first = num_layers if first is None else int(first)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not types:
        return (), None
    if not isinstance(types, list | tuple) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config.json: layer_types must be a list of strings, got {types!r}")
    if "sliding_attention" not in types and len(types) == num_layers and set(types) == {"full_attention"}:
        return (), None
    if isinstance(window, bool) or not isinstance(window, int | None):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    return tuple(types), window
