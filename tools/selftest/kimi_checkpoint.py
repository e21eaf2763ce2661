"""A random Kimi-K2.6-shaped checkpoint (INT4 routed experts), written tensor by tensor.

    python -m ddtree.tools.selftest.kimi_checkpoint --out DIR [--layers 2] [--experts 384] [--hidden 7168]
        [--vocab 163840] [--heads 64] [--q-lora 1536] [--kv-lora 512] [--moe-width 2048] [--dense-width 18432]
        [--shard-gb 2] [--seed 0] [--no-vision]

The layout of the released Kimi K2.6: `config.json` with `model_type` kimi_k25 and the text model in
`text_config` (docs/kimi_k26_config.json, with its quantization_config: compressed-tensors pack-quantized,
4-bit symmetric groups of 32, Kimi's ignore list: attention, shared experts, dense MLP, lm_head, vision),
text weights under the `language_model.` prefix, a few small vision-tower tensors beside them, and
safetensors shards listed in `model.safetensors.index.json`. Defaults are the full width; the first
`--dense-layers` layers are dense, the others MoE.

Values (seeded, reproducible: one generator per tensor, seeded from --seed and the tensor's index):
embedding, lm_head, attention, dense MLP and shared experts bf16 N(0, 0.02); norms 1 (bf16); router weight
N(0, 0.02) and e_score_correction_bias N(0, 0.05), fp32 (as HF saves them and the loader holds them);
routed experts as stored INT4: `weight_packed` random int32 words (every nibble uniform in [-8, 7]),
`weight_scale` bf16 uniform in [0.5, 1.5] x 0.02 / 4.64 (4.64 = the nibbles' rms, so W has std ~0.02),
`weight_shape` int32 [out, in]. Nothing is quantized from a float matrix.

Memory: the safetensors headers are computed from the shapes first, then each tensor is generated in
chunks of at most CHUNK_BYTES and appended to its shard, so the writer holds one chunk at a time.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

K26_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "kimi_k26_config.json"  # tools/selftest/ -> the checkout
PREFIX = "language_model."
CHUNK_BYTES = 64 << 20
STD = 0.02
BIAS_STD = 0.05
NIBBLE_RMS = math.sqrt(21.5)  # E[(n - 8)^2] for n uniform in 0..15
GROUP = 32
PACK = 8  # int4 values per int32 word
VISION = {  # a few tensors of the vision tower / projector: the loader and inspect must skip them
    "vision_tower.patch_embed.proj.weight": (1152, 3, 14, 14),
    "vision_tower.blocks.0.norm0.weight": (1152,),
    "mm_projector.proj.0.weight": (7168, 1152),
}
DTYPES = {"BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4), "I32": (torch.int32, 4)}


@dataclass(frozen=True)
class Spec:
    name: str  # stored name (with the prefix)
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype
    kind: str  # normal | ones | bias | packed | scale | shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def make_config(args: argparse.Namespace) -> dict:
    if not K26_CONFIG.is_file():
        raise FileNotFoundError(f"{K26_CONFIG}: the released Kimi K2.6 config.json, in a checkout of the repository")
    raw = json.loads(K26_CONFIG.read_text())
    raw.pop("_note", None)
    text = raw["text_config"]
    text.update(
        num_hidden_layers=args.layers,
        first_k_dense_replace=args.dense_layers,
        n_routed_experts=args.experts,
        hidden_size=args.hidden,
        vocab_size=args.vocab,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora,
        kv_lora_rank=args.kv_lora,
        moe_intermediate_size=args.moe_width,
        intermediate_size=args.dense_width,
        num_experts_per_tok=min(text["num_experts_per_tok"], args.experts),
        bos_token_id=min(text["bos_token_id"], args.vocab - 2),
        eos_token_id=min(text["eos_token_id"], args.vocab - 1),
    )
    text["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = args.group
    raw["vision_config"]["text_hidden_size"] = args.hidden
    raw["_note"] = (
        "random Kimi-K2.6-shaped checkpoint written by ddtree.tools.selftest.kimi_checkpoint "
        f"(seed {args.seed}): not a trained model"
    )
    return raw


def tensor_specs(raw: dict, group: int, vision: bool) -> list[Spec]:
    """Every stored tensor, in checkpoint order (layer by layer; per expert gate, up, down)."""
    from ddtree.models.checkpoint.weight_bytes import config_tensors
    from ddtree.models.deepseek_v3.config import DeepseekV3Config

    config = DeepseekV3Config.from_dict(copy.deepcopy(raw))
    out: list[Spec] = []
    for s in config_tensors(config):
        name = PREFIX + s.name
        if s.group == "routed_experts":
            rows, cols = s.shape
            if cols % group:
                raise ValueError(f"{s.name}: in_features {cols} is not a multiple of the group {group}")
            stem = name.removesuffix(".weight")
            out.append(Spec(stem + ".weight_packed", (rows, cols // PACK), "I32", "packed"))
            out.append(Spec(stem + ".weight_scale", (rows, cols // group), "BF16", "scale"))
            out.append(Spec(stem + ".weight_shape", (2,), "I32", "shape"))
        elif s.name.endswith("e_score_correction_bias"):
            out.append(Spec(name, s.shape, "F32", "bias"))
        elif s.name.endswith("mlp.gate.weight"):
            out.append(Spec(name, s.shape, "F32", "normal"))
        elif s.name.endswith("norm.weight"):
            out.append(Spec(name, s.shape, "BF16", "ones"))
        else:
            out.append(Spec(name, s.shape, "BF16", "normal"))
    if vision:
        for name, shape in VISION.items():
            shape = tuple(raw["text_config"]["hidden_size"] if n == 7168 else n for n in shape)
            out.append(Spec(name, shape, "BF16", "ones" if "norm" in name else "normal"))
    return out


def chunks(spec: Spec, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """The tensor's values, in row chunks of at most CHUNK_BYTES, in its stored dtype (not `weight_shape`)."""
    rows = spec.shape[0]
    row_numel = math.prod(spec.shape[1:])
    row_bytes = max(1, row_numel * DTYPES[spec.dtype][1])
    step = max(1, CHUNK_BYTES // row_bytes)
    for r0 in range(0, rows, step):
        shape = (min(step, rows - r0), *spec.shape[1:])
        if spec.kind == "packed":  # random bytes: every nibble uniform in 0..15, i.e. a value in [-8, 7]
            n = math.prod(shape)
            yield torch.randint(0, 256, (n * 4,), dtype=torch.uint8, generator=gen).view(torch.int32).view(shape)
        elif spec.kind == "scale":
            base = STD / NIBBLE_RMS
            yield (torch.rand(shape, generator=gen).add_(0.5).mul_(base)).to(torch.bfloat16)
        elif spec.kind == "ones":
            yield torch.ones(shape, dtype=DTYPES[spec.dtype][0])
        else:
            std = BIAS_STD if spec.kind == "bias" else STD
            yield torch.randn(shape, generator=gen).mul_(std).to(DTYPES[spec.dtype][0])


def plan_shards(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """Consecutive tensors per shard (as save_pretrained does); a quantized weight's companions stay together."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if size >= shard_bytes and s.kind not in ("scale", "shape"):
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def write_shard(path: Path, specs: list[Spec], seed: int, index0: int, logical_cols: dict[str, int]) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for i, s in enumerate(specs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index0 + i)
            if s.kind == "shape":
                weight = s.name.removesuffix("_shape")
                value = torch.tensor([logical_cols[weight][0], logical_cols[weight][1]], dtype=torch.int32)
                f.write(value.numpy().tobytes())
                continue
            written = 0
            for c in chunks(s, gen):
                data = c.contiguous().view(torch.uint8).numpy()
                f.write(data)
                written += data.nbytes
            assert written == s.nbytes, (s.name, written, s.nbytes)
    return offset


def write_checkpoint(args: argparse.Namespace) -> Path:
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    raw = make_config(args)
    specs = tensor_specs(raw, args.group, not args.no_vision)
    logical = {}  # X.weight -> (out, in) of every INT4 weight
    for s in specs:
        if s.kind == "packed":
            logical[s.name.removesuffix("_packed")] = (s.shape[0], s.shape[1] * PACK)
    shards = plan_shards(specs, int(args.shard_gb * 1e9))
    total = sum(s.nbytes for s in specs)
    print(f"writing {len(specs)} tensors, {total / 1e9:.2f} GB, in {len(shards)} shards to {root}", flush=True)
    weight_map: dict[str, str] = {}
    started = time.perf_counter()
    index0 = 0
    for k, part in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        t0 = time.perf_counter()
        nbytes = write_shard(root / file, part, args.seed, index0, logical)
        index0 += len(part)
        weight_map.update(dict.fromkeys((s.name for s in part), file))
        print(f"  {file}: {len(part)} tensors, {nbytes / 1e9:.2f} GB, {time.perf_counter() - t0:.1f} s", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    experts = sum(s.nbytes for s in specs if s.kind in ("packed", "scale", "shape"))
    print(
        f"done in {time.perf_counter() - started:.1f} s: {total / 1e9:.2f} GB, of which packed routed experts "
        f"{experts / 1e9:.2f} GB",
        flush=True,
    )
    return root


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory (created)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace: leading dense layers")
    p.add_argument("--experts", type=int, default=384, help="routed experts per MoE layer")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--q-lora", type=int, default=1536)
    p.add_argument("--kv-lora", type=int, default=512)
    p.add_argument("--moe-width", type=int, default=2048, help="moe_intermediate_size")
    p.add_argument("--dense-width", type=int, default=18432, help="intermediate_size (dense MLP)")
    p.add_argument("--group", type=int, default=GROUP, help="INT4 group size")
    p.add_argument("--shard-gb", type=float, default=2.0, help="shard size, GB (1e9 bytes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vision", action="store_true", help="no vision-tower tensors")
    args = p.parse_args(argv)
    if not 1 <= args.dense_layers <= args.layers:
        p.error("--dense-layers must be in [1, --layers]")
    return args


def main(argv: list[str] | None = None) -> int:
    write_checkpoint(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
