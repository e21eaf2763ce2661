"""Peak resident memory of `load_target`, whole and as tensor-parallel rank 0 of 2.

    python -m scripts.bench.measure_load_memory [--dir DIR] [--shard-mb 100] [--int4]

Writes a sharded bf16 random checkpoint of a few hundred MB (a DeepSeek-V3-shaped config scaled down;
--int4: its routed experts INT4 pack-quantized, group 32, as Kimi K2.x ships them), then loads it in a
fresh subprocess per mode and prints peak RSS (`ru_maxrss`) minus the RSS before the load (after the
imports and a warm-up load of a tiny checkpoint, which pages in torch's kernels), next to the bytes the
loaded model holds (packed weights stay packed):
- whole: every tensor;
- half: rank 0 of 2 (ShardPlan + build_tp_model: half of every splittable weight, heads, MLP / expert
  widths, vocab; replicated tensors whole), read through its `slice_of`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
    "moe_intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "max_position_embeddings": 4096, "rope_theta": 10000.0, "bos_token_id": 0,
    "eos_token_id": 1,
}  # fmt: skip


INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                     "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}  # fmt: skip


def write_checkpoint(root: Path, shard_mb: float, int4: bool = False) -> Path:
    import torch
    from safetensors.torch import save_file

    from ddtree.kernels.quant_formats import quantize_int4_group
    from ddtree.models.checkpoint.random import random_target_state_dict
    from ddtree.models.deepseek_v3.config import DeepseekV3Config

    config = DeepseekV3Config.from_dict(MEASURE_CONFIG)
    tensors = random_target_state_dict(config, seed=0, dtype=torch.bfloat16)
    if int4:
        for name in [n for n in tensors if ".mlp.experts." in n]:
            stem = name.removesuffix(".weight")
            w = tensors.pop(name)
            tensors[stem + ".weight_packed"], tensors[stem + ".weight_scale"], tensors[stem + ".weight_shape"] = (
                quantize_int4_group(w.float(), 32)
            )
    root.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():  # consecutive tensors per shard, as save_pretrained does
        if size > shard_mb * 1e6:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(root / file))
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))  # fmt: skip
    quant = {"quantization_config": INT4_CONFIG} if int4 else {}
    (root / "config.json").write_text(json.dumps({**config.to_hf_dict(), "torch_dtype": "bfloat16", **quant}))
    return root


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(root: Path, mode: str) -> None:
    from ddtree.models.checkpoint.loader import load_config, load_target
    from ddtree.models.checkpoint.random import write_random_target
    from ddtree.models.parallel.shard_plan import ShardPlan
    from ddtree.models.parallel.tp_model import build_tp_model

    kw = {}
    if mode == "half":  # rank 0 of 2, built and read as a TP rank is (no process group needed)
        plan = ShardPlan(load_config(root), 0, 2)
        kw = dict(build_model=lambda c: build_tp_model(plan, None), slice_of=plan.slice_of)

    imported = rss_mb()
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: torch's lazily loaded kernels and allocator pools
        load_target(write_random_target(Path(tmp), {**MEASURE_CONFIG, "num_hidden_layers": 1, "vocab_size": 256,
                                                    "hidden_size": 64, "intermediate_size": 64}))  # fmt: skip
    base = rss_mb()
    model = load_target(root, **kw)
    peak = rss_mb()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
    print(json.dumps({"mode": mode, "imported_mib": round(imported, 1), "baseline_mib": round(base, 1),
                      "peak_mib": round(peak, 1),
                      "load_peak_mib": round(peak - base, 1), "model_mib": round(held, 1)}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--shard-mb", type=float, default=100.0)
    p.add_argument("--int4", action="store_true", help="routed experts INT4 pack-quantized (group 32)")
    p.add_argument("--child", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.child[1] == "write":
            write_checkpoint(Path(args.child[0]), args.shard_mb, args.int4)
        else:
            child(Path(args.child[0]), args.child[1])
        return 0
    # NOTE: every step runs in its own subprocess of this small parent: Linux carries ru_maxrss across
    # fork + exec, so a child of a process that once held the generated tensors would start at its peak.
    cwd = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp) / "ckpt"
        if not (root / "model.safetensors.index.json").exists():
            cmd = [sys.executable, __file__, "--shard-mb", str(args.shard_mb), "--child", str(root), "write"]
            cmd += ["--int4"] if args.int4 else []
            subprocess.run(cmd, check=True, cwd=cwd)
        files = sorted(root.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files) / 2**20
        print(f"checkpoint {root}: {len(files)} shards, {size:.1f} MiB bf16{' + INT4 experts' if args.int4 else ''}")
        for mode in ("whole", "half"):
            cmd = [sys.executable, __file__, "--child", str(root), mode]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{mode:>5}: peak RSS over baseline {r['load_peak_mib']:8.1f} MiB  (model holds {r['model_mib']:.1f} "
                f"MiB; RSS after imports {r['imported_mib']:.1f}, after a warm-up load {r['baseline_mib']:.1f} MiB)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
