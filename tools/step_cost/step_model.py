"""The model a `ddtree bench step` measures: a checkpoint's, or random weights made on the device from a
config, whole (TP 1) or one rank's shard of a TP-N model (`--emulate-tp N`).

A shard is what services/models/parallel/ builds for rank 0 of N (tp_model.build_tp_model over a
shard_plan.ShardPlan): its H/N heads, its columns of every MLP and routed expert (or, with expert
parallelism, its E/N whole experts), its V/N rows of the embedding and the LM head; its decoder layers
all-reduce in `tp`, here a one-rank group. `--layers L` keeps the first L decoder layers (a checkpoint's
later layers are not read).

Random weights follow the checkpoint's formats (the config's quantization_config: INT4 routed experts
in Kimi's case, as quantization/packed_modules.py gives a loaded model) and are drawn on the device:
floats N(0, 0.02), norms 1, the router's correction bias N(0, 0.05), INT4 words uniform with group
scales around 0.02 / NIBBLE_RMS, FP8 values N(0, 1) in e4m3 with scale 0.02. A tensor of more than
RANDOM_BLOCK elements repeats one random block of that size: the values keep their distribution (a
step's cost does not depend on them) and a full-width shard is made in seconds on a CPU too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import torch
from torch import nn

from ddtree.models.checkpoint.loader import TEXT_PREFIX, load_target, quantization_config, read_config_dict
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import resolve_attention_backend
from ddtree.models.layers.norm import RMSNorm
from ddtree.models.parallel.process_group import TPGroup
from ddtree.models.parallel.shard_plan import ShardPlan
from ddtree.models.parallel.tp_model import build_tp_model
from ddtree.models.quantization import parse_quantization
from ddtree.models.quantization.packed_modules import pack_modules

STD = 0.02
BIAS_STD = 0.05
NIBBLE_RMS = math.sqrt(21.5)  # rms of (n - 8) for n uniform in 0..15
ROUTER_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # drawn whole
FP32_SUFFIXES = ("mlp.gate.e_score_correction_bias",)  # fp32; the router's weight in the model's dtype, as Kimi /
# DeepSeek checkpoints store it (bf16) and the loader keeps it (loader.py)
RANDOM_BLOCK = 1 << 20  # elements drawn per tensor at most; larger tensors repeat them
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    source: str  # a checkpoint directory, or a config.json file (with random_weights)
    random_weights: bool
    device: str
    dtype: str = "auto"  # auto: the checkpoint's stored dtype; random weights: the config's, else bf16
    layers: int = 0  # 0 = the config's num_hidden_layers
    emulate_tp: int = 1  # > 1: rank 0's shard of a TP-N model
    tp: int = 1  # > 1: real ranks (step_ranks.py); this process builds `rank`'s shard
    rank: int = 0
    expert_parallel: bool = False
    kernels: str = "auto"  # the attention backend follows it (tools/step_cost/kernel_route.py)
    seed: int = 0


class _NoFiles:
    """pack_modules' view of a checkpoint that has no files: no stored scale dtypes (bf16 is assumed)."""

    def __contains__(self, name: str) -> bool:
        return False


def read_raw_config(spec: ModelSpec) -> dict:
    return read_config_dict(spec.source)


def model_config(spec: ModelSpec, raw: dict) -> DeepseekV3Config:
    config = DeepseekV3Config.from_dict(raw)
    if spec.layers:
        if not 0 < spec.layers <= config.num_hidden_layers:
            raise ValueError(f"--layers {spec.layers}: the model has {config.num_hidden_layers} decoder layers")
        config = dataclasses.replace(config, num_hidden_layers=spec.layers)
    return config


def model_dtype(spec: ModelSpec, raw: dict) -> torch.dtype | None:
    """None: the checkpoint's stored dtype (the loader decides)."""
    if spec.dtype != "auto":
        return getattr(torch, spec.dtype)
    if not spec.random_weights:
        return None
    name = (raw.get("text_config") or raw).get("torch_dtype") or "bfloat16"
    return getattr(torch, name)


def _builder(spec: ModelSpec, tp: TPGroup | None, backend: str):
    """(build(config) -> model on meta, the shard plan or None)."""
    plans: list[ShardPlan] = []

    def build(config: DeepseekV3Config) -> nn.Module:
        config = dataclasses.replace(config, num_hidden_layers=spec.layers or config.num_hidden_layers)
        world = max(spec.tp, spec.emulate_tp)
        if world <= 1:
            return DeepseekV3ForCausalLM(config, attention_backend=backend)
        plans.append(ShardPlan(config, spec.rank, world, spec.expert_parallel))
        return build_tp_model(plans[-1], tp, backend)

    return build, plans


def build_model(spec: ModelSpec, tp: TPGroup | None, allocate: bool = True) -> DeepseekV3ForCausalLM:
    """The measured model, eval mode, on spec.device; `tp` is the group of a shard (one rank when emulated).
    allocate False (random weights only): every tensor stays on meta, in the dtype it would have (the
    roofline's shapes-only step, tools/roofline/step_roofline.py)."""
    raw = read_raw_config(spec)
    config = model_config(spec, raw)
    backend = resolve_attention_backend("auto" if spec.kernels == "auto" else spec.kernels, spec.device)
    build, plans = _builder(spec, tp, backend)
    dtype = model_dtype(spec, raw)
    if not spec.random_weights:
        kept = config.num_hidden_layers

        def skip(name: str) -> bool:
            m = _LAYER.match(name)
            return (m is not None and int(m.group(1)) >= kept) or (bool(plans) and plans[-1].skip(name))

        model = load_target(
            spec.source,
            dtype,
            spec.device,
            backend,
            build_model=build,
            slice_of=lambda name: plans[-1].slice_of(name) if plans else None,
            skip=skip,
        )
        return model.eval()
    with torch.device("meta"):
        model = build(config)
    scheme = parse_quantization(quantization_config(raw), str(spec.source))
    if scheme is not None:
        prefix = TEXT_PREFIX if "text_config" in raw else ""
        pack_modules(model, scheme, prefix, _NoFiles())
    if allocate:
        fill_random(model, torch.device(spec.device), dtype, spec.seed)
    else:
        meta_dtypes(model, dtype)
    return model.eval()


def meta_dtypes(model: nn.Module, dtype: torch.dtype) -> None:
    """Every tensor on meta in the dtype fill_random would give it (buffers made elsewhere moved to meta)."""
    for module_name, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for leaf, t in store.items():
                if t is None:
                    continue
                want = t.dtype  # a tensor made off meta (RoPE's inv_freq) keeps its dtype, as fill_random's
                if t.is_meta and t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                    fp32 = f"{module_name}.{leaf}".endswith(FP32_SUFFIXES)
                    want = torch.float32 if fp32 else t.dtype if leaf.startswith("weight_scale") else dtype
                new = t.to(device="meta", dtype=want)
                store[leaf] = nn.Parameter(new, requires_grad=False) if store is module._parameters else new


def fill_random(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """Every tensor still on meta: allocated on `device` and drawn there; the others moved there."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for leaf, t in store.items():
                if t is None:
                    continue
                if not t.is_meta:
                    store[leaf] = t.to(device)
                    continue
                qualified = f"{module_name}.{leaf}"
                with torch.no_grad():
                    value = _random_tensor(module, leaf, qualified, t, device, dtype, gen)
                store[leaf] = nn.Parameter(value, requires_grad=False) if store is module._parameters else value


def _random_tensor(module, leaf, qualified, meta, device, dtype, gen) -> torch.Tensor:
    small = meta.numel() <= RANDOM_BLOCK or qualified.endswith(ROUTER_SUFFIXES)  # the router: drawn whole
    if small or leaf == "weight_shape" or isinstance(module, RMSNorm):
        return _draw(module, leaf, qualified, meta, meta.shape, device, dtype, gen)
    block = _draw(module, leaf, qualified, meta, (RANDOM_BLOCK,), device, dtype, gen)
    out = torch.empty(meta.shape, dtype=block.dtype, device=device)
    flat = out.view(-1)
    whole = flat.numel() // RANDOM_BLOCK * RANDOM_BLOCK
    flat[:whole].view(-1, RANDOM_BLOCK).copy_(block.expand(whole // RANDOM_BLOCK, RANDOM_BLOCK))
    flat[whole:].copy_(block[: flat.numel() - whole])
    return out


def _draw(module, leaf, qualified, meta, shape, device, dtype, gen) -> torch.Tensor:
    if leaf == "weight_packed":  # INT4: 8 nibbles per int32 word, all uniform
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device, generator=gen)
    if leaf == "weight_shape":  # [N, K] of each (stacked) projection
        value = torch.tensor([module.out_features, module.in_features], dtype=torch.int32, device=device)
        return value.expand(shape).contiguous()
    if leaf == "weight_scale":  # INT4 group scales: W = (n - 8) * scale has std about STD
        u = torch.rand(shape, device=device, generator=gen) + 0.5
        return (u * (STD / NIBBLE_RMS)).to(meta.dtype)
    if leaf == "weight_scale_inv":  # FP8 block scales
        return torch.full(shape, STD, dtype=meta.dtype, device=device)
    if meta.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.randn(shape, device=device, generator=gen).clamp(-448, 448).to(meta.dtype)
    if not meta.is_floating_point():
        return torch.zeros(shape, dtype=meta.dtype, device=device)
    want = torch.float32 if qualified.endswith(FP32_SUFFIXES) else dtype
    if isinstance(module, RMSNorm) or leaf == "bias" and not qualified.endswith("e_score_correction_bias"):
        return (torch.ones if isinstance(module, RMSNorm) else torch.zeros)(shape, dtype=want, device=device)
    std = BIAS_STD if qualified.endswith("e_score_correction_bias") else STD
    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * std).to(want)


def describe(model: DeepseekV3ForCausalLM, spec: ModelSpec) -> dict:
    """The config echo of the JSON: logical sizes and what this rank holds."""
    from ddtree.models.deepseek_v3.moe import DeepseekV3MoE

    c = model.config
    layer0 = model.model.layers[0]
    moe = next((layer.mlp for layer in model.model.layers if isinstance(layer.mlp, DeepseekV3MoE)), None)
    experts = moe.experts if moe is not None else None
    return {
        "source": str(Path(spec.source)),
        "random_weights": spec.random_weights,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "local_heads": layer0.self_attn.num_heads,
        "routed_experts": c.n_routed_experts,
        "local_experts": experts.num_local if experts is not None else 0,
        "experts_per_token": c.num_experts_per_tok,
        "local_expert_width": experts.gate_proj.out_features if experts is not None else 0,
        "expert_kind": experts.gate_proj.kind if experts is not None else None,
        "vocab_size": c.vocab_size,
        "local_vocab": model.lm_head.out_features,
        "kv_lora_rank": c.kv_lora_rank,
        "dtype": str(model.dtype).removeprefix("torch."),
        "attention_backend": type(model.attn_backend).__name__,
        "expert_parallel": spec.expert_parallel,
    }
