"""DFlash drafter checkpoints: a directory of `config.json` (DFlash format, dflash_config.py) and safetensors
files whose tensor names are the `DFlashDraftModel` state_dict names (fc.weight, layers.{i}.self_attn.q_proj.
weight, ...; no embedding, no LM head).

`load_drafter` reads every `*.safetensors` file of the directory (whatever their names: z-lab checkpoints
are one file, sharded ones need no index) through the shared `CheckpointFiles` reader, and is strict: every
missing, unexpected or misshapen tensor is named before anything is read. `write_random_drafter` writes a
reproducible random drafter for a target (tests, the CPU demo, the start of drafter training).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from .checkpoint_files import SAFETENSORS_DTYPES, CheckpointFiles, checkpoint_weight_map
from .config import RopeConfig
from .dflash import DFlashDraftModel
from .dflash_config import DFlashConfig, default_target_layer_ids


def load_drafter(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> DFlashDraftModel:
    """Load config.json + *.safetensors. Strict: every missing, unexpected or misshapen key is named.

    dtype None = the checkpoint's fc.weight dtype (all weights are cast to one dtype). The weights are
    copied out of the memory-mapped files, so the directory may be rewritten after the load.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json")
    cfg = DFlashConfig.from_dict(json.loads(cfg_file.read_text()))
    weight_map = checkpoint_weight_map(path, every_file=True)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with CheckpointFiles(path, weight_map) as files:
        missing = sorted(set(expected) - set(weight_map))
        unexpected = sorted(set(weight_map) - set(expected))
        misshapen = [
            f"{k} {files.shape(k)} != {expected[k]}"
            for k in sorted(set(expected) & set(weight_map))
            if files.shape(k) != expected[k]
        ]
        if missing or unexpected or misshapen:
            raise ValueError(
                f"{path}: drafter weights do not match config.json: missing keys {missing}; "
                f"unexpected keys {unexpected}; shape mismatches {misshapen}"
            )
        dtype = dtype or SAFETENSORS_DTYPES[files.dtype("fc.weight")][0]
        state = {k: files.read(k).to(device=device, dtype=dtype, copy=True) for k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def write_random_drafter(
    path: str | Path,
    target: Mapping[str, Any],
    seed: int = 0,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    rope_theta: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a reproducible random drafter for `target` (a target config.json dict, or just
    {hidden_size, num_hidden_layers, vocab_size}) to path/{config.json, model.safetensors}.

    Defaults: mask token = vocab_size - 1; taps = the z-lab default ids when they are distinct and in
    range for this target (they are not for targets under ~6 layers), else ids spread over all layers;
    default RoPE with the target's rope_theta (its scaling is not copied). Same arguments -> same bytes.
    Init, in sorted-name order from one generator seeded with `seed`: linears N(0, 1) / sqrt(in_features),
    norm weights 1 + 0.1 * N(0, 1), biases 0.02 * N(0, 1); drawn in fp32, then cast to `dtype`.
    """
    path = Path(path)
    hidden, num_target, vocab = int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])
    if target_layer_ids is None:
        ids = default_target_layer_ids(num_target, num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_target:
            m = min(num_layers, num_target)
            ids = tuple(sorted({round(i * (num_target - 1) / max(m - 1, 1)) for i in range(m)}))
        target_layer_ids = ids
    cfg = DFlashConfig(
        hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden // num_attention_heads,
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids),
        target_hidden_size=hidden,
        num_target_layers=num_target,
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig(theta=float(rope_theta or target.get("rope_theta", 10000.0))),
        max_position_embeddings=int(target.get("max_position_embeddings", 32768)),
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DFlashDraftModel(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 2:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:  # biases
            w = 0.02 * torch.randn(shape, generator=gen)
        state[name] = w.to(dtype).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    config = cfg.to_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
