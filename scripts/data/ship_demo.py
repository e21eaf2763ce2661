"""Copy a trained target + drafter pair into checkpoints/demo/, the embedded default.

    python -m scripts.data.ship_demo --target runs/target/export --drafter runs/drafter/export [--out checkpoints/demo]

Weights are stored in bf16 to stay within the 30 MB the repository allows (the router's gate weight and
expert-selection bias stay fp32, as DeepSeek-V3 checkpoints keep them); the services load them in the
dtype they run in (fp32 on the CPU). The tokenizer travels with the target. A manifest records sizes,
sha256 and the training provenance found next to the exports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LIMIT_BYTES = 30 * 1024 * 1024


def _to_bf16(src: pathlib.Path, dst: pathlib.Path) -> None:
    tensors = load_file(str(src))
    out = {
        k: (v if k.endswith(KEEP_FP32) or not v.is_floating_point() else v.to(torch.bfloat16)).contiguous()
        for k, v in tensors.items()
    }
    save_file(out, str(dst), metadata={"format": "pt"})


def ship(target: pathlib.Path, drafter: pathlib.Path, out: pathlib.Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    (out / "target").mkdir(parents=True)
    (out / "drafter").mkdir(parents=True)
    shutil.copy(target / "config.json", out / "target" / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(target / name, out / "target" / name)
    _to_bf16(target / "model.safetensors", out / "target" / "model.safetensors")
    shutil.copy(drafter / "config.json", out / "drafter" / "config.json")
    _to_bf16(drafter / "model.safetensors", out / "drafter" / "model.safetensors")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    manifest = {
        "files": {
            str(p.relative_to(out)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in files
        },
        "total_bytes": sum(p.stat().st_size for p in files),
        "target_training": _json_or_none(target / "training_info.json"),
        "drafter_training": _json_or_none(drafter / "training_info.json") or _json_or_none(drafter / "training.json"),
    }
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise SystemExit(f"the demo pair is {manifest['total_bytes'] / 2**20:.1f} MB, over the 30 MB limit")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _json_or_none(path: pathlib.Path):
    return json.loads(path.read_text()) if path.exists() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=pathlib.Path, required=True)
    p.add_argument("--drafter", type=pathlib.Path, required=True)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("checkpoints/demo"))
    args = p.parse_args(argv)
    manifest = ship(args.target, args.drafter, args.out)
    print(f"shipped {args.out}: {manifest['total_bytes'] / 2**20:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
