"""The weights of a DeepSeek-V3 / Kimi checkpoint, tensor by tensor: shapes from config.json, stored bytes from
the safetensors headers (or, with no weights, from quantization_config and `torch_dtype`), and the bytes one
tensor-parallel rank holds once loaded.

Shared by `ddtree inspect` (tools/inspect.py) and the engines' memory plan (models/checkpoint/memory_plan.py), so that
the plan a service checks before loading and the one `inspect` prints are one count.

Held bytes (what loader.py keeps, per rank): quantized weights stay packed (a rank's share of the words and
scales, INT4's `weight_shape` whole); the router's `mlp.gate.weight` keeps its stored float dtype and its
`e_score_correction_bias` is fp32 whatever the engine's dtype (loader.ROUTER_WEIGHT, FP32_SUFFIXES); every
other float tensor is in the engine's dtype (by default the stored dtype of the embedding, as the loader
chooses). tests/models/test_inspect_matches_loader.py
checks them against a loaded model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ddtree.models.checkpoint.files import INDEX_FILE, SINGLE_FILE, CheckpointError, read_header
from ddtree.models.checkpoint.loader import FP32_SUFFIXES, ROUTER_WEIGHT
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.quantization import parse_quantization

TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FLOAT_FORMAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}  # unquantized formats: cast on load
HEADER_FORMATS = {"F8_E4M3": "fp8", "I32": "int4", "BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
_COMPANION = re.compile(r"\.weight(_scale_inv|_packed|_scale|_shape)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_TEXT_PREFIX = "language_model."


@dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name (without a kimi_k25 `language_model.` prefix)
    shape: tuple[int, ...]
    group: str
    split: int | None  # TP: 0 = rows, 1 = columns, None = replicated; routed experts: see `rank_numel`
    unit: int = 1  # rows/cols come in units of this (a head's width) when split

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def config_tensors(c: DeepseekV3Config) -> list[TensorSpec]:
    """Every weight of the text model, named and shaped as in the checkpoint (MTP layers excluded)."""
    d, H, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim
    out = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, d), "embed", 0)]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."

        def add(name, shape, group, split=None, unit=1, p=p):
            out.append(TensorSpec(p + name, shape, group, split, unit))

        add("input_layernorm.weight", (d,), "norms")
        add("post_attention_layernorm.weight", (d,), "norms")
        a = "self_attn."
        if c.q_lora_rank is None:
            add(a + "q_proj.weight", (H * qk, d), "attention", 0, qk)
        else:
            add(a + "q_a_proj.weight", (c.q_lora_rank, d), "attention")
            if c.attention_bias:
                add(a + "q_a_proj.bias", (c.q_lora_rank,), "attention")
            add(a + "q_a_layernorm.weight", (c.q_lora_rank,), "attention")
            add(a + "q_b_proj.weight", (H * qk, c.q_lora_rank), "attention", 0, qk)
        add(a + "kv_a_proj_with_mqa.weight", (c.kv_cache_width, d), "attention")
        if c.attention_bias:
            add(a + "kv_a_proj_with_mqa.bias", (c.kv_cache_width,), "attention")
        add(a + "kv_a_layernorm.weight", (c.kv_lora_rank,), "attention")
        add(a + "kv_b_proj.weight", (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), "attention", 0,
            c.qk_nope_head_dim + c.v_head_dim)  # fmt: skip
        add(a + "o_proj.weight", (d, H * c.v_head_dim), "attention", 1, c.v_head_dim)
        if c.attention_bias:
            add(a + "o_proj.bias", (d,), "attention")
        if not c.is_moe_layer(i):
            _mlp(add, "mlp.", d, c.intermediate_size, "dense_mlp")
            continue
        add("mlp.gate.weight", (c.n_routed_experts, d), "router")
        add("mlp.gate.e_score_correction_bias", (c.n_routed_experts,), "router")
        for e in range(c.n_routed_experts):
            _mlp(add, f"mlp.experts.{e}.", d, c.moe_intermediate_size, "routed_experts")
        if c.n_shared_experts:
            _mlp(add, "mlp.shared_experts.", d, c.moe_intermediate_size * c.n_shared_experts, "shared_experts")
    out.append(TensorSpec("model.norm.weight", (d,), "norms", None))
    out.append(TensorSpec("lm_head.weight", (c.vocab_size, d), "lm_head", 0))
    return out


def _mlp(add, prefix: str, d: int, width: int, group: str) -> None:
    add(prefix + "gate_proj.weight", (width, d), group, 0)
    add(prefix + "up_proj.weight", (width, d), group, 0)
    add(prefix + "down_proj.weight", (d, width), group, 1)


def rank_numel(spec: TensorSpec, tp: int, ep: bool = False, n_experts: int = 0) -> int:
    """Elements of `spec` held by rank 0 (the largest share) of `tp` ranks (whole units, ceil-divided)."""
    if spec.group == "routed_experts" and ep:
        e = int(_EXPERT.search(spec.name).group(1))
        return spec.numel if e < math.ceil(n_experts / tp) else 0
    if spec.split is None or tp == 1:
        return spec.numel
    units = spec.shape[spec.split] // spec.unit
    return spec.numel // spec.shape[spec.split] * math.ceil(units / tp) * spec.unit


def read_headers(root: Path) -> dict[str, dict] | None:
    """Merged safetensors headers of the checkpoint's weight files, or None when there are no weights."""
    index = root / INDEX_FILE
    if index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (root / SINGLE_FILE).exists():
        files = [root / SINGLE_FILE]
    else:
        return None
    merged: dict[str, dict] = {}
    for f in files:
        merged.update(read_header(f))
    return merged


def sizes_from_headers(
    headers: dict[str, dict], specs: list[TensorSpec], c: DeepseekV3Config
) -> dict[str, tuple[str, int, int]]:
    """logical name -> (format, stored bytes incl. scales, bytes of them every holder keeps whole: INT4's
    `weight_shape`) from the headers; vision / MTP tensors ignored."""
    prefix = _TEXT_PREFIX if any(n.startswith(_TEXT_PREFIX) for n in headers) else ""
    sizes: dict[str, list] = {}
    for name, h in headers.items():
        if not name.startswith(prefix):
            continue
        local = name[len(prefix) :]
        m = _LAYER.match(local)
        if m and int(m.group(1)) >= c.num_hidden_layers:
            continue
        logical = _COMPANION.sub(".weight", local)
        entry = sizes.setdefault(logical, [None, 0, 0])
        entry[1] += h["data_offsets"][1] - h["data_offsets"][0]
        if local.endswith("_shape"):
            entry[2] += h["data_offsets"][1] - h["data_offsets"][0]
        if logical == local or local.endswith("_packed"):
            entry[0] = HEADER_FORMATS.get(h["dtype"], h["dtype"].lower())
    missing = [s.name for s in specs if s.name not in sizes]
    if missing:
        raise CheckpointError(f"{len(missing)} tensors of the config are not in the checkpoint, e.g. {missing[0]}")
    return {n: tuple(v) for n, v in sizes.items()}


def sizes_from_config(raw: dict, specs: list[TensorSpec], source: str) -> dict[str, tuple[str, int, int]]:
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    scheme = parse_quantization(qc, source)
    text = raw.get("text_config") or raw
    torch_dtype = text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    width = TORCH_DTYPE_BYTES.get(torch_dtype, 2)
    base = {2: "bf16" if torch_dtype == "bfloat16" else "fp16", 4: "fp32"}[width]
    prefix = _TEXT_PREFIX if "text_config" in raw else ""
    out = {}
    for s in specs:
        module = s.name.rpartition(".")[0]
        names = (prefix + module, module)
        quantized = scheme is not None and s.name.endswith(".weight") and len(s.shape) == 2 and scheme.quantizes(names)
        if s.name.endswith("e_score_correction_bias"):
            out[s.name] = ("fp32", 4 * s.numel, 0)
        elif quantized:
            fmt, (group, block) = scheme.weight_format, scheme.params(names)
            out[s.name] = (fmt.label(group, block), *fmt.stored_bytes(*s.shape, group, block))
        else:
            out[s.name] = (base, width * s.numel, 0)
    return out


@dataclass(frozen=True)
class CheckpointWeights:
    """Every text-model tensor of a checkpoint with its stored format and bytes, and what one rank holds."""

    raw: dict  # config.json as read
    config: DeepseekV3Config
    dtype_source: str  # "safetensors headers" or "quantization_config + torch_dtype"
    specs: tuple[TensorSpec, ...]
    stored: dict[str, tuple[str, int, int]]  # name -> (format, stored bytes incl. scales, bytes kept whole)
    tp: int
    ep: bool
    held_dtype_bytes: int  # width of the unquantized float tensors once loaded (the router excepted)
    params_per_rank: int  # rank 0's, the largest share
    bytes_per_rank: int


def read_checkpoint_weights(
    path: str | Path, tp: int = 1, ep: bool = False, dtype_bytes: int | None = None
) -> CheckpointWeights:
    """path: a checkpoint directory or its config.json. dtype_bytes: the engine's float width (None = the
    embedding's stored one, as load_target(dtype=None))."""
    if tp < 1:
        raise ValueError(f"--tp: must be >= 1, got {tp}")
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    raw = json.loads(cfg_file.read_text())
    config = DeepseekV3Config.from_dict(raw)
    specs = config_tensors(config)
    headers = read_headers(cfg_file.parent)
    if headers is not None:
        sizes, source = sizes_from_headers(headers, specs, config), "safetensors headers"
    else:
        sizes, source = sizes_from_config(raw, specs, str(cfg_file)), "quantization_config + torch_dtype"
    width = dtype_bytes or FLOAT_FORMAT_BYTES.get(sizes["model.embed_tokens.weight"][0], 2)
    held_bytes = held_params = 0
    for s in specs:
        held = rank_numel(s, tp, ep, config.n_routed_experts)
        held_params += held
        held_bytes += held_tensor_bytes(s, sizes[s.name], held, width)
    return CheckpointWeights(raw, config, source, tuple(specs), sizes, tp, ep, width, held_params, held_bytes)


def held_tensor_bytes(spec: TensorSpec, stored: tuple[str, int, int], held_numel: int, dtype_bytes: int) -> int:
    """Bytes a rank holding `held_numel` elements of `spec` keeps once loaded (see the module docstring)."""
    fmt, nbytes, whole = stored
    if not held_numel:
        return 0
    if fmt in FLOAT_FORMAT_BYTES:
        if spec.name.endswith(ROUTER_WEIGHT):  # kept in its stored dtype (loader._materialize's `kept`)
            return held_numel * FLOAT_FORMAT_BYTES[fmt]
        return held_numel * (4 if spec.name.endswith(FP32_SUFFIXES) else dtype_bytes)
    # packed: a share of the words and scales; the INT4 `weight_shape` [2] is kept whole by every holder
    return (nbytes - whole) * held_numel // spec.numel + whole
