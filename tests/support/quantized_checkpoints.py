"""Tiny quantized / sharded / kimi_k25-wrapped checkpoints made from one random fp32 model, for loader tests.

`write_variant(dir, kind, ...)` starts from `write_random_target` (fp32, HF layout) and rewrites its tensors:
- "fp32": as is (optionally sharded); "bf16": cast to bf16 except the router (fp32, as HF saves it);
- "fp8": every projection weight -> float8_e4m3fn + `weight_scale_inv` block scales (real amax/448 scales);
- "int4": routed experts only -> compressed-tensors pack-quantized, Kimi's ignore list;
optionally wrapped as kimi_k25 (`text_config`, `language_model.` prefix, vision tower tensors added).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddtree.models.checkpoint.loader import TensorSlice
from ddtree.models.checkpoint.random import write_random_target
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.deepseek_v3.moe_experts import PROJECTIONS, StackedExperts
from ddtree.models.layers.attention import AttentionMetadata, SeqAttention
from ddtree.models.layers.merged_linear import unmerge_all
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear
from ddtree.models.quantization import quantize_fp8_block, quantize_int4_group

TINY: dict[str, Any] = dict(
    model_type="deepseek_v3", vocab_size=320, hidden_size=96, intermediate_size=200, moe_intermediate_size=44,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=40, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.827, max_position_embeddings=1024, rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=32),
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip
FP32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # stored fp32 in bf16 checkpoints too
FP8_BLOCK = (16, 32)  # small blocks so that the tiny shapes have ragged edge blocks
INT4_GROUP = 32
KIMI_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]  # fmt: skip
VISION = {"vision_tower.patch_embed.proj.weight": (8, 3, 2, 2), "vision_tower.blocks.0.norm0.weight": (8,),
          "mm_projector.proj.0.weight": (96, 8)}  # fmt: skip


def fp8_config(block=FP8_BLOCK, **extra) -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
            **extra}  # fmt: skip


def int4_config(group: int = INT4_GROUP) -> dict[str, Any]:
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}  # fmt: skip
    return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "ignore": KIMI_IGNORE, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}  # fmt: skip


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def write_variant(
    root: Path,
    kind: str,
    cfg: dict[str, Any] | None = None,
    seed: int = 0,
    shards: int = 1,
    kimi_k25: bool = False,
    fp8_skip: tuple[str, ...] = (),
    fp8_block: tuple[int, int] = FP8_BLOCK,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """-> (checkpoint dir, the fp32 source tensors it was made from)."""
    src = write_random_target(root.parent / f"{root.name}-src", cfg or TINY, seed=seed)
    config = json.loads((src / "config.json").read_text())
    source = load_file(src / "model.safetensors")
    out, config = quantized(source, config, kind, fp8_skip, fp8_block)
    if kimi_k25:
        text = {**config, "model_type": "kimi_k2"}
        config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                  "text_config": text, "vision_config": {"vt_hidden_size": 8}}  # fmt: skip
        out = {"language_model." + n: t for n, t in out.items()}
        g = torch.Generator().manual_seed(99)
        out.update({n: torch.randn(s, generator=g) for n, s in VISION.items()})
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    save_sharded(out, root, shards)
    return root, source


def quantized(
    source: dict[str, torch.Tensor], config: dict[str, Any], kind: str, fp8_skip=(), fp8_block=FP8_BLOCK
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of fp32 `source` tensors rewritten as `kind` (see the module docstring)."""
    config = dict(config)
    out: dict[str, torch.Tensor] = {}
    for name, w in source.items():
        stem = name.removesuffix(".weight")
        if kind == "bf16":
            out[name] = w if name.endswith(FP32_KEPT) else w.to(torch.bfloat16)
        elif kind == "fp8" and "_proj" in name and name.endswith(".weight") and not any(s in name for s in fp8_skip):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(w, fp8_block)
        elif kind == "int4" and is_routed_expert(name):
            out[stem + ".weight_packed"], out[stem + ".weight_scale"], out[stem + ".weight_shape"] = (
                quantize_int4_group(w, INT4_GROUP)
            )
        else:
            out[name] = w
    if kind == "bf16":
        config["torch_dtype"] = "bfloat16"
    if kind == "fp8":
        config["quantization_config"] = fp8_config(fp8_block, modules_to_not_convert=list(fp8_skip) or None)
    elif kind == "int4":
        config["quantization_config"] = int4_config()
    return out, config


def quantize_checkpoint(src: Path, dst: Path, kind: str, fp8_block=FP8_BLOCK) -> Path:
    """A copy of the fp32 single-file checkpoint `src` (tokenizer files included) with its weights as `kind`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    out, config = quantized(load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text()),
                            kind, fp8_block=fp8_block)  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    save_file(out, str(dst / "model.safetensors"))
    return dst


def save_sharded(tensors: dict[str, torch.Tensor], root: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
        return
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}  # interleaved: scales land in other shards
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def dequant_fp8_reference(q: torch.Tensor, scale_inv: torch.Tensor, block=FP8_BLOCK) -> torch.Tensor:
    """Independent of the loader: expand every scale over its block with repeat_interleave, crop, multiply."""
    M, N = q.shape
    s = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:M, :N]
    return q.to(torch.float32) * s


def state_dict_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in model.state_dict().items()}


def shrink_to_slices(model: nn.Module, slice_of) -> nn.Module:
    """Give each sliced parameter / buffer of a meta model its sliced shape (what a TP rank would hold).

    Routed experts are stacked per projection (`mlp.experts.{proj}.weight` [E, N, K]): their per-expert
    names must all get the same slice, which is applied to the stacked tensor's dims 1..2. Merged linears
    (gate_up_proj, fused_qkv_a_proj_with_mqa) are split into their parts first: each may be sliced its own way."""
    unmerge_all(model)
    done = set()
    for name, t in list(model.state_dict().items()):
        sl = slice_of(name)
        if sl is None:
            continue
        shape = list(t.shape)
        shape[sl.dim] = sl.stop - sl.start
        m = _STACKED.match(name)
        if m is not None:  # `...mlp.experts.{g}.{proj}.weight` -> the stacked `...mlp.experts.{proj}.weight`
            module = model.get_submodule(f"{m.group(1)}.{m.group(2)}")
            key = (id(module), m.group(3))
            if key in done:
                assert list(getattr(module, m.group(3)).shape[1:]) == shape, f"{name}: experts sliced differently"
                continue
            done.add(key)
            shape = [getattr(module, m.group(3)).shape[0], *shape]
            _replace(module, m.group(3), torch.empty(shape, dtype=t.dtype, device="meta"))
            continue
        module_name, _, leaf = name.rpartition(".")
        _replace(model.get_submodule(module_name), leaf, torch.empty(shape, dtype=t.dtype, device="meta"))
    return model


_STACKED = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.(\w+)$")


def _replace(module: nn.Module, leaf: str, empty: torch.Tensor) -> None:
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(empty, requires_grad=False)
    else:
        module._buffers[leaf] = empty


def dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict tensor as fp32 under its logical name, packed weights (Int4Linear / Fp8Linear,
    int4 / fp8 stacked experts) dequantized by the modules themselves; companions dropped."""
    out = {n: t.detach().float() for n, t in model.state_dict().items() if not _COMPANION.search(n)}
    for name, m in model.named_modules():
        if isinstance(m, (Int4Linear, Fp8Linear)):
            out[name + ".weight"] = m.dequantized()
        elif isinstance(m, StackedExperts):
            for proj_name, proj in zip(PROJECTIONS, m.projections(), strict=True):
                w = proj.expert_weights()
                for i in range(m.num_local):
                    out[f"{name}.{m.first + i}.{proj_name}.weight"] = w.dequantize(i)
    return out


_COMPANION = re.compile(r"\.weight_(packed|scale|shape|scale_inv)$")


def apply_slice(t: torch.Tensor, sl: TensorSlice | None) -> torch.Tensor:
    if sl is None:
        return t
    return t.narrow(sl.dim, sl.start, sl.stop - sl.start)


def odd_slices(shapes: dict[str, tuple[int, ...]]):
    """A slice_of that cuts every 2-D weight at unaligned bounds, alternating dims; 1-D: the upper half."""

    def slice_of(name: str) -> TensorSlice | None:
        shape = shapes[name]
        if "norm" in name:
            return None
        if len(shape) == 1:
            return TensorSlice(0, shape[0] // 2, shape[0])
        dim = 1 if (len(name) % 2 and shape[1] > 8) else 0
        n = shape[dim]
        return TensorSlice(dim, n // 3 + 1, n - n // 5 - 1)

    return slice_of


def logits(model: DeepseekV3ForCausalLM, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    meta = AttentionMetadata((SeqAttention(0, n, torch.empty(0, dtype=torch.int64), torch.arange(n), None),))
    return model(torch.tensor(ids), torch.arange(n), meta, model.new_kv_cache(n)).logits
