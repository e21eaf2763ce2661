"""Load an HF-layout DeepSeek-V3 / Kimi-K2 checkpoint into DeepseekV3ForCausalLM (model.md §5).

Reads `model.safetensors` or a sharded `model.safetensors.index.json` (every tensor resolved through
`weight_map`), memory-mapped with `safetensors.safe_open`. The model is built on the meta device and each
tensor is assigned as it is read, so peak memory is about one copy of the weights. MTP layers
(`model.layers.{n}.*` with n >= num_hidden_layers) are skipped. The router `mlp.gate.weight` and
`mlp.gate.e_score_correction_bias` stay fp32 whatever `dtype` is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from .config import DeepseekV3Config
from .deepseek_v3 import DeepseekV3ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint does not match the model (names or shapes)."""


def checkpoint_weight_map(path: str | Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: root / shard for name, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def load_tensors(path: str | Path, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read just the named tensors (stored dtype) from a checkpoint directory."""
    names = list(names)
    weight_map = checkpoint_weight_map(path)
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise CheckpointError(f"{_summary(missing)} not found in checkpoint {path}")
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for n in names:
            file = weight_map[n]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt", device=str(device)))
            out[n] = handles[file].get_tensor(n)
    return out


def load_target(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch",
) -> DeepseekV3ForCausalLM:
    """Build the model from `<path>/config.json` and load its weights.

    dtype None = the stored dtype of `model.embed_tokens.weight`. The config is attached as `.config`.
    """
    root = Path(path)
    with open(root / "config.json") as f:
        raw = json.load(f)
    if raw.get("quantization_config") is not None:
        qm = raw["quantization_config"].get("quant_method", "?")
        raise NotImplementedError(f"quantized checkpoints (quant_method={qm!r}) are not supported yet")
    config = DeepseekV3Config.from_dict(raw)
    weight_map = checkpoint_weight_map(root)
    weight_map = {n: f for n, f in weight_map.items() if not _is_mtp(n, config.num_hidden_layers)}

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, attention_backend=attention_backend)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = [n for n in expected if n not in weight_map]
    unexpected = [n for n in weight_map if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_summary(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_summary(unexpected)}")
        raise CheckpointError(f"checkpoint {root} does not match the model; " + "; ".join(parts))

    by_file: dict[Path, list[str]] = {}
    for n in expected:
        by_file.setdefault(weight_map[n], []).append(n)
    if dtype is None:
        with safe_open(weight_map["model.embed_tokens.weight"], framework="pt") as f:
            stored = f.get_slice("model.embed_tokens.weight").get_dtype()
        if stored not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"model.embed_tokens.weight has stored dtype {stored}; pass dtype= explicitly")
        dtype = _SAFETENSORS_DTYPES[stored]
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for n in names:
                shape = tuple(f.get_slice(n).get_shape())
                if shape != expected[n]:
                    raise CheckpointError(
                        f"tensor {n}: checkpoint shape {list(shape)} != model shape {list(expected[n])}"
                    )
                want = torch.float32 if n.endswith(FP32_SUFFIXES) else dtype
                _assign(model, n, f.get_tensor(n).to(device=device, dtype=want))
    model.model.rotary_emb.to(device)  # the only non-checkpoint buffer (inv_freq, built on CPU)
    return model.eval()


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
}  # fmt: skip


def _is_mtp(name: str, num_layers: int) -> bool:
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise CheckpointError(f"tensor {name}: no parameter or buffer {leaf!r} on {module_name}")


def _summary(names: list[str], first: int = 5) -> str:
    shown = ", ".join(names[:first])
    more = f" (+{len(names) - first} more)" if len(names) > first else ""
    return f"{len(names)} [{shown}{more}]"
