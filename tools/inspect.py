"""`ddtree inspect CHECKPOINT`: sizes of a DeepSeek-V3 / Kimi checkpoint from its config.json alone.

`inspect_checkpoint(path, tp, ...)` is a pure function of the config (plus, when the weights are there, the
safetensors headers for the stored dtype mix) returning an `InspectReport`; `format_report` prints it.

Counting (exact, from the config; names and shapes as in deepseek_v3.py == the checkpoint):
- parameters per group: embedding, MLA attention (q_a/q_b or q_proj, kv_a_proj_with_mqa, kv_b, o, the two
  a-layernorms), layer norms (+ final norm), dense MLPs, routed experts, shared experts, router (weight +
  e_score_correction_bias), lm_head. Active = everything except routed experts, plus top-k of them per MoE
  layer.
- tensor parallel N (rank 0, the largest share): attention heads split (q_b / q_proj / kv_b rows, o_proj
  columns), MLP / shared / routed expert widths split, embedding and lm_head split by vocab; q_a, kv_a,
  norms and the router replicated. `--ep`: routed experts are split whole across ranks instead. The latent
  KV cache (c_kv + k_pe) is replicated: every rank stores (kv_lora_rank + qk_rope_head_dim) per token per
  layer.
- weight bytes: from the headers when the weights exist, else from quantization_config (INT4 pack-quantized:
  packed int32 + bf16 group scales; FP8: 1 byte + fp32 block scales) and `torch_dtype` for the rest. Per
  rank they are what the loader holds: quantized weights stay packed (a rank's share of the words and
  scales, INT4's `weight_shape` whole); tests/test_inspect_matches_loader.py checks the two agree.
- largest context = (device memory · (1 - reserve) - weights per rank) / KV bytes per token per rank, with
  `ACTIVATION_RESERVE` of the device kept for activations, workspace and the allocator.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddtree.models.checkpoint_files import INDEX_FILE, SINGLE_FILE, CheckpointError, read_header
from ddtree.models.config import DeepseekV3Config
from ddtree.models.quantization import Fp8BlockScheme, Int4PackScheme, parse_quantization

ACTIVATION_RESERVE = 0.10  # share of device memory kept free of weights and KV
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GROUPS = ("embed", "attention", "norms", "dense_mlp", "routed_experts", "shared_experts", "router", "lm_head")
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


def count_parameters(c: DeepseekV3Config, tp: int = 1, ep: bool = False) -> dict[str, int]:
    """Parameters per group (rank 0 of `tp` ranks), computed in closed form from the config."""
    d, H, L, V = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.vocab_size
    share = lambda n: math.ceil(n / tp)  # noqa: E731
    n_moe = L - c.first_k_dense_replace
    heads = share(H)
    q = heads * c.qk_head_dim * (d if c.q_lora_rank is None else c.q_lora_rank)
    if c.q_lora_rank is not None:
        q += c.q_lora_rank * d + c.q_lora_rank + (c.q_lora_rank if c.attention_bias else 0)
    kv = c.kv_cache_width * d + c.kv_lora_rank + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    kv += c.kv_cache_width if c.attention_bias else 0
    o = d * heads * c.v_head_dim + (d if c.attention_bias else 0)
    expert = 3 * d * c.moe_intermediate_size
    routed = share(c.n_routed_experts) * expert if ep else c.n_routed_experts * 3 * d * share(c.moe_intermediate_size)
    return {
        "embed": share(V) * d,
        "attention": L * (q + kv + o),
        "norms": (2 * L + 1) * d,
        "dense_mlp": c.first_k_dense_replace * 3 * d * share(c.intermediate_size),
        "routed_experts": n_moe * routed,
        "shared_experts": n_moe * 3 * d * share(c.moe_intermediate_size * c.n_shared_experts),
        "router": n_moe * (c.n_routed_experts * d + c.n_routed_experts),
        "lm_head": share(V) * d,
    }


def active_parameters(c: DeepseekV3Config) -> int:
    counts = count_parameters(c)
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    return (
        sum(counts.values())
        - counts["routed_experts"]
        + n_moe * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    )


@dataclass(frozen=True)
class FormatShare:
    format: str  # int4-g32 | fp8-128x128 | bf16 | fp32 | ...
    params: int
    bytes: int  # stored bytes, scales included


@dataclass(frozen=True)
class InspectReport:
    source: str
    dtype_source: str  # "safetensors headers" or "quantization_config"
    model_type: str
    config: DeepseekV3Config
    params: dict[str, int]
    total_params: int
    active_params: int
    dtype_mix: list[FormatShare]
    weight_bytes: int
    kv_dtype: str
    kv_bytes_per_token: int  # all layers; replicated under TP, so also per rank
    tp: int
    ep: bool
    params_per_rank: int
    weight_bytes_per_rank: int
    device_memory_gb: float | None = None
    reserve: float = ACTIVATION_RESERVE
    max_context_tokens: int | None = None
    notes: list[str] = field(default_factory=list)


def inspect_checkpoint(
    path: str | Path, tp: int = 1, device_memory_gb: float | None = None, kv_dtype: str = "bf16", ep: bool = False
) -> InspectReport:
    """path: a checkpoint directory or a config.json file."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    raw = json.loads(cfg_file.read_text())
    config = DeepseekV3Config.from_dict(raw)
    if tp < 1:
        raise ValueError(f"--tp: must be >= 1, got {tp}")
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-dtype: {kv_dtype!r} not in {sorted(KV_DTYPE_BYTES)}")
    specs = config_tensors(config)
    headers = _headers(cfg_file.parent)
    if headers is not None:
        sizes, dtype_source = _sizes_from_headers(headers, specs, config), "safetensors headers"
    else:
        sizes, dtype_source = _sizes_from_config(raw, specs, str(cfg_file)), "quantization_config + torch_dtype"
    mix: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    per_rank = 0
    params_rank = 0
    for s in specs:
        fmt, nbytes, whole = sizes[s.name]
        mix[fmt][0] += s.numel
        mix[fmt][1] += nbytes
        held = rank_numel(s, tp, ep, config.n_routed_experts)
        params_rank += held
        # the INT4 `weight_shape` [2] is not split: a rank holding part of the weight holds all of it
        per_rank += (nbytes - whole) * held // s.numel + (whole if held else 0)
    params = count_parameters(config)
    kv = config.kv_cache_width * config.num_hidden_layers * KV_DTYPE_BYTES[kv_dtype]
    max_ctx = None
    if device_memory_gb is not None:
        free = device_memory_gb * 1e9 * (1 - ACTIVATION_RESERVE) - per_rank
        max_ctx = max(0, int(free // kv))
    notes = []
    for what, n in (("num_attention_heads", config.num_attention_heads), ("vocab_size", config.vocab_size),
                    ("moe_intermediate_size", config.moe_intermediate_size),
                    ("n_routed_experts" if ep else "intermediate_size",
                     config.n_routed_experts if ep else config.intermediate_size)):  # fmt: skip
        if n % tp:
            notes.append(f"{what} {n} is not divisible by --tp {tp}; rank 0 holds the rounded-up share")
    return InspectReport(
        source=str(path), dtype_source=dtype_source, model_type=raw.get("model_type", "deepseek_v3"), config=config,
        params=params, total_params=sum(params.values()), active_params=active_parameters(config),
        dtype_mix=sorted((FormatShare(f, v[0], v[1]) for f, v in mix.items()), key=lambda m: -m.bytes),
        weight_bytes=sum(v[1] for v in mix.values()), kv_dtype=kv_dtype, kv_bytes_per_token=kv, tp=tp, ep=ep,
        params_per_rank=params_rank, weight_bytes_per_rank=per_rank, device_memory_gb=device_memory_gb,
        max_context_tokens=max_ctx, notes=notes,
    )  # fmt: skip


def _headers(root: Path) -> dict[str, dict] | None:
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


def _sizes_from_headers(
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


def _sizes_from_config(raw: dict, specs: list[TensorSpec], source: str) -> dict[str, tuple[str, int, int]]:
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
        elif quantized and isinstance(scheme, Int4PackScheme):
            g = scheme.group_of(names).group_size
            rows, cols = s.shape
            out[s.name] = (f"int4-g{g}", rows * math.ceil(cols / 8) * 4 + rows * math.ceil(cols / g) * 2 + 8, 8)
        elif quantized and isinstance(scheme, Fp8BlockScheme):
            (bm, bn), (rows, cols) = scheme.block, s.shape
            out[s.name] = (f"fp8-{bm}x{bn}", rows * cols + math.ceil(rows / bm) * math.ceil(cols / bn) * 4, 0)
        else:
            out[s.name] = (base, width * s.numel, 0)
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _count(n: int) -> str:
    return f"{n:,} ({n / 1e12:.3f} T)" if n >= 1e12 else f"{n:,} ({n / 1e9:.2f} B)"


def format_report(r: InspectReport) -> str:
    c = r.config
    rope = f"yarn x{c.rope.factor:g} from {c.rope.original_max_position_embeddings}" if c.rope.is_yarn else "default"
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    q = f"q_lora {c.q_lora_rank}" if c.q_lora_rank else "q_proj"
    lines = [
        f"checkpoint     {r.source}",
        f"architecture   DeepseekV3ForCausalLM (model_type {r.model_type}, text {c.model_type}): {c.num_hidden_layers} "
        f"layers ({c.first_k_dense_replace} dense + {n_moe} MoE), hidden {c.hidden_size}, vocab {c.vocab_size}",
        f"attention      MLA, {c.num_attention_heads} heads, {q}, kv_lora {c.kv_lora_rank}, "
        f"qk {c.qk_nope_head_dim}+{c.qk_rope_head_dim}, v {c.v_head_dim}",
        f"experts        {c.n_routed_experts} routed (top {c.num_experts_per_tok}) + {c.n_shared_experts} shared, "
        f"width {c.moe_intermediate_size}; dense MLP width {c.intermediate_size}",
        f"context        max_position_embeddings {c.max_position_embeddings}, rope theta {c.rope.theta:g}, {rope}",
        f"parameters     total {_count(r.total_params)}, active {_count(r.active_params)} "
        f"(top-{c.num_experts_per_tok} routed experts)",
    ]
    lines += [f"  {g:<15}{r.params[g]:>18,}" for g in GROUPS if r.params[g]]
    lines.append(f"dtype mix      (from {r.dtype_source})")
    for m in r.dtype_mix:
        lines.append(
            f"  {m.format:<15}{m.params:>18,} params  {_gb(m.bytes):>12}  {100 * m.bytes / r.weight_bytes:5.1f}%"
        )
    lines.append(f"  {'total':<15}{r.total_params:>18,} params  {_gb(r.weight_bytes):>12}")
    lines.append(
        f"KV cache       {c.kv_cache_width} x {c.num_hidden_layers} layers x {KV_DTYPE_BYTES[r.kv_dtype]} B ({r.kv_dtype}) "
        f"= {r.kv_bytes_per_token:,} B per token (latent, replicated on every rank)"
    )
    split = "attention heads, MLP widths, vocab split; routed experts " + (
        "whole per rank (EP)" if r.ep else "width split"
    )
    lines.append(f"per rank       TP {r.tp}: {split}")
    lines.append(f"  weights      {r.params_per_rank:,} params, {_gb(r.weight_bytes_per_rank)}")
    lines.append(f"  KV           {r.kv_bytes_per_token:,} B per token")
    if r.device_memory_gb is not None:
        reserve = r.device_memory_gb * 1e9 * r.reserve
        free = r.device_memory_gb * 1e9 - reserve - r.weight_bytes_per_rank
        lines.append(
            f"device         {r.device_memory_gb:g} GB (1e9 B): {r.reserve:.0%} reserve for activations "
            f"({_gb(reserve)}), weights {_gb(r.weight_bytes_per_rank)}, left for KV {_gb(max(free, 0))}"
        )
        fits = "weights do not fit" if free <= 0 else f"{r.max_context_tokens:,} tokens"
        lines.append(f"  max context  {fits} (total over all sequences on the device)")
    lines += [f"note           {n}" for n in r.notes]
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="parameter counts, dtype mix and memory per rank of a checkpoint (config.json)")
    p.add_argument("checkpoint", help="checkpoint directory or config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks")
    p.add_argument("--device-memory-gb", type=float, default=None, help="memory of one device, GB (1e9 bytes)")
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPE_BYTES))
    p.add_argument("--ep", action="store_true", help="expert parallel: routed experts split whole across ranks")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_checkpoint(args.checkpoint, args.tp, args.device_memory_gb, args.kv_dtype, args.ep)
    except FileNotFoundError as err:  # one clear line from the CLI, not a traceback
        raise ValueError(f"{args.checkpoint}: no checkpoint config here ({err.strerror}: {err.filename})") from None
    if args.json:
        d = asdict(report)
        d["config"] = d["config"]["model_type"]
        print(json.dumps(d, indent=2))
    else:
        print(format_report(report))
    return 0
