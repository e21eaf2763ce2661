"""DFlash drafter checkpoints: a directory of `config.json` (DFlash format, dflash_config.py) and safetensors
files whose tensor names are the `DFlashDraftModel` state_dict names (fc.weight, layers.{i}.self_attn.q_proj.
weight, ...; no embedding, no LM head).

This is the layout z-lab publishes its drafters in (e.g. z-lab/Kimi-K2.5-DFlash, z-lab/Qwen3-8B-DFlash-b16):
unprefixed names, no `embed_tokens` / `lm_head` (the drafter uses the target's), taps, block size and mask id
in config.json (tests/drafter/test_dflash_published.py loads a reduced-width checkpoint of the Kimi shape).

`load_drafter` reads every `*.safetensors` file of the directory (whatever their names: z-lab checkpoints
are one file, sharded ones need no index) through the shared `CheckpointFiles` reader, and is strict:
`check_drafter_tensors` names every missing, unexpected or misshapen tensor, with the file it is in (or the
files read) and a hint, before anything is read. It is the one check of a drafter's tensors (training
loads through `load_drafter` too). `write_random_drafter` writes a reproducible random drafter for a target
(tests, the CPU demo, the start of drafter training).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from ddtree.models.checkpoint.files import SAFETENSORS_DTYPES, CheckpointError, CheckpointFiles, checkpoint_weight_map
from ddtree.models.deepseek_v3.config import RopeConfig
from ddtree.models.dflash.config import DFlashConfig, default_target_layer_ids
from ddtree.models.dflash.model import DFlashDraftModel


def load_drafter(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> DFlashDraftModel:
    """Load config.json + *.safetensors. Strict: every missing, unexpected or misshapen tensor is named,
    with its file, in one CheckpointError (a ValueError; `check_drafter_tensors`).

    dtype None = the checkpoint's fc.weight dtype (all weights are cast to one dtype). The weights are
    copied out of the memory-mapped files, so the directory may be rewritten after the load.

    A YaRN drafter (rope_scaling or rope_parameters of type yarn) multiplies the cos/sin of q and k by the
    YaRN attention factor, so its attention logits by the factor's square: `rope_scaling.attention_factor`
    when config.json gives it, else transformers' rule (mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set, else 1 + 0.1 ln(factor)). The published Kimi-K2.5 drafter's config
    (factor 64, mscale = mscale_all_dim = 1) gets 1.0 by that rule, where SGLang and vLLM <= 0.29 use
    1 + 0.1 ln(64) ~ 1.416: write `"attention_factor": 1.4158883` into its rope_scaling to run it as those
    servers do (docs/design.md §6, "The DFlash drafter checkpoint").
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
        check_drafter_tensors(path, cfg, expected, files)
        dtype = dtype or SAFETENSORS_DTYPES[files.dtype("fc.weight")][0]
        state = {k: files.read(k).to(device=device, dtype=dtype, copy=True) for k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


_SHOWN = 10  # tensors named per kind of mismatch; the rest are counted


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]}{more}"


def _unexpected_hint(name: str, cfg: DFlashConfig, expected: Mapping[str, tuple[int, ...]]) -> str:
    """Why a tensor the model does not have may be there."""
    if re.search(r"(^|\.)(embed_tokens|lm_head)\.", name):
        return "the drafter has no embedding or LM head of its own (it uses the target's): remove the tensor"
    if name.startswith("model.") and name.removeprefix("model.") in expected:
        return "drafter tensors are stored without a 'model.' prefix (fc.weight, layers.0.self_attn.q_proj.weight, ...)"
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
        return f"config.json has num_hidden_layers {cfg.num_hidden_layers}"
    if re.fullmatch(r"layers\.\d+\.self_attn\.[qkvo]_proj\.bias", name) and not cfg.attention_bias:
        return "config.json has attention_bias false"
    return "not a tensor of the DFlash drafter that config.json describes"


def check_drafter_tensors(
    path: Path, cfg: DFlashConfig, expected: Mapping[str, tuple[int, ...]], files: CheckpointFiles
) -> None:
    """Raise CheckpointError unless `files` holds exactly the `expected` tensors (name -> shape).

    The first line lists the missing, unexpected and misshapen names; then one line per tensor (up to 10
    of each kind) with the file it is in, or the files read for a missing one, and a hint."""
    missing = sorted(set(expected) - set(files.weight_map))
    unexpected = sorted(set(files.weight_map) - set(expected))
    misshapen = [k for k in sorted(set(expected) & set(files.weight_map)) if files.shape(k) != expected[k]]
    if not (missing or unexpected or misshapen):
        return
    read = ", ".join(sorted({f.name for f in files.weight_map.values()}))
    lines = [
        f"{path}: drafter weights do not match config.json: missing keys {_listed(missing)}; "
        f"unexpected keys {_listed(unexpected)}; shape mismatches "
        f"{_listed([f'{k} {files.shape(k)} != {expected[k]}' for k in misshapen])}"
    ]
    lines += [f"  missing tensor {k} (files read: {read})" for k in missing[:_SHOWN]]
    lines += [
        f"  unexpected tensor {k} in {files.file_of(k).name}: {_unexpected_hint(k, cfg, expected)}"
        for k in unexpected[:_SHOWN]
    ]
    for k in misshapen[:_SHOWN]:
        hint = ""
        if k == "fc.weight":
            hint = (
                " (fc is [hidden_size, len(target_layer_ids) * target_hidden_size] = "
                f"[{cfg.hidden_size}, {len(cfg.target_layer_ids)} * {cfg.target_hidden_size}])"
            )
        lines.append(
            f"  tensor {k} in {files.file_of(k).name} is {files.shape(k)}, config.json makes it {expected[k]}{hint}"
        )
    raise CheckpointError("\n".join(lines))


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
    attention: Mapping[str, Any] | None = None,
) -> Path:
    """Write a reproducible random drafter for `target` (a target config.json dict, or just
    {hidden_size, num_hidden_layers, vocab_size}) to path/{config.json, model.safetensors}.

    Defaults: mask token = vocab_size - 1; taps = the z-lab default ids when they are distinct and in
    range for this target (they are not for targets under ~6 layers), else ids spread over all layers;
    default RoPE with the target's rope_theta (its scaling is not copied). Same arguments -> same bytes.
    attention: DFlashConfig's block-attention fields (causal_head, draft_shift, layer_types, sliding_window).
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
        **dict(attention or {}),
    )
    cfg.validate()
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
