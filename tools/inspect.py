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
  rank they are what the loader holds (models/checkpoint/weight_bytes.py: packed weights stay packed, the router fp32);
  tests/models/test_inspect_matches_loader.py checks the two agree.
- largest context = (device memory · (1 - reserve) - weights per rank) / KV bytes per token per rank, with
  `ACTIVATION_RESERVE` of the device kept for activations, workspace and the allocator.
- with --device-memory-gb, the memory plan GPU by GPU (tools/gpu_plan.py: verifier ranks, and the drafter
  with --drafter, its ranks beside the verifier's by default), the one the services check at start-up: the
  tightest GPU and the largest KV that fits, which is then the JSON report's max_context_tokens (the formula
  above is the estimate without a plan; the text prints both).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddtree.models.checkpoint.memory_plan import format_plan
from ddtree.models.checkpoint.weight_bytes import read_checkpoint_weights
from ddtree.models.deepseek_v3.config import DeepseekV3Config

ACTIVATION_RESERVE = 0.10  # share of device memory kept free of weights and KV
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
GROUPS = ("embed", "attention", "norms", "dense_mlp", "routed_experts", "shared_experts", "router", "lm_head")


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
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"--kv-dtype: {kv_dtype!r} not in {sorted(KV_DTYPE_BYTES)}")
    w = read_checkpoint_weights(path, tp, ep)
    raw, config, per_rank, params_rank = w.raw, w.config, w.bytes_per_rank, w.params_per_rank
    mix: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in w.specs:
        fmt, nbytes, _ = w.stored[s.name]
        mix[fmt][0] += s.numel
        mix[fmt][1] += nbytes
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
        source=str(path), dtype_source=w.dtype_source, model_type=raw.get("model_type", "deepseek_v3"), config=config,
        params=params, total_params=sum(params.values()), active_params=active_parameters(config),
        dtype_mix=sorted((FormatShare(f, v[0], v[1]) for f, v in mix.items()), key=lambda m: -m.bytes),
        weight_bytes=sum(v[1] for v in mix.values()), kv_dtype=kv_dtype, kv_bytes_per_token=kv, tp=tp, ep=ep,
        params_per_rank=params_rank, weight_bytes_per_rank=per_rank, device_memory_gb=device_memory_gb,
        max_context_tokens=max_ctx, notes=notes,
    )  # fmt: skip


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
    p.add_argument(
        "--drafter",
        default=None,
        help="with --device-memory-gb: a DFlash drafter (dir or config.json), at the verifier's --tp beside its "
        "ranks (--drafter-args '--tp 1': whole, on GPU 0)",
    )
    p.add_argument(
        "--verifier-args", default="", help="the verifier's flags for the plan, one string (e.g. '--kv-memory-gb 8')"
    )
    p.add_argument(
        "--drafter-args", default="", help="the drafter's flags for the plan, one string (e.g. '--window 2048')"
    )
    p.set_defaults(fn=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_checkpoint(args.checkpoint, args.tp, args.device_memory_gb, args.kv_dtype, args.ep)
    except FileNotFoundError as err:  # one clear line from the CLI, not a traceback
        raise ValueError(f"{args.checkpoint}: no checkpoint config here ({err.strerror}: {err.filename})") from None
    plan = None
    if args.device_memory_gb is not None:  # the memory plan, GPU by GPU (tools/gpu_plan.py)
        from ddtree.tools.gpu_plan import deployment_configs, deployment_plan

        verifier, drafter = deployment_configs(args.tp, args.ep, args.verifier_args, args.drafter_args)
        plan = deployment_plan(args.checkpoint, args.device_memory_gb, verifier, drafter, args.drafter)
    if args.json:
        d = asdict(report)
        d["config"] = d["config"]["model_type"]
        if plan is not None:
            d["memory_plan"] = plan_json(plan)
            # the context the plan holds: its largest KV pool, every other item of every GPU counted
            d["max_context_tokens"] = plan.largest_kv_tokens
            d["notes"].append("max_context_tokens: the memory plan's largest KV pool, not the reserve estimate")
        print(json.dumps(d, indent=2))
    else:
        print(format_report(report))
        if plan is not None:
            print("memory plan    per GPU (" + ("verifier + drafter" if args.drafter else "verifier") + ")")
            print(format_plan(plan))
    return 0


def plan_json(plan) -> dict:
    d = asdict(plan)
    d.update(fits=plan.fits, tightest_gpu=plan.tightest.index, largest_kv_tokens=plan.largest_kv_tokens)
    for g, gpu in zip(d["gpus"], plan.gpus):
        g.update(used=gpu.used, headroom=gpu.headroom)
    return d
