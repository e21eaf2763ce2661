"""Load an HF-layout DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 checkpoint into a model (docs/design.md §6).

Reads `model.safetensors` or a sharded `model.safetensors.index.json` (every tensor, scales included,
resolved through `weight_map`), memory-mapped. The model is built on the meta device, its tensors are
allocated once at their final (local) size and dtype, and each is filled in place as it is read, one shard
at a time (routed experts: slot e of the stacked tensor, through the per-expert state-dict views); the
files are unmapped after each shard and before a read would take the mapped bytes past MAX_MAPPED_BYTES,
and large plain tensors are read in row parts, so peak memory is about the weights this process holds
plus MAX_MAPPED_BYTES of file pages and one part. Stored dtypes come from
the safetensors headers.

- Quantized weights stay in their stored format (quantization/packed_modules.py gives the model packed
  modules first): FP8 e4m3 with block `weight_scale_inv` (quantization/fp8_block.py) and INT4
  compressed-tensors pack-quantized groups (quantization/int4_pack.py); which modules are quantized comes
  from the config's quantization_config (targets / ignore lists). A slice of a packed weight must cut on
  whole FP8 blocks / INT4 groups (CheckpointError otherwise). `dequantize=True` instead dequantizes them
  on the CPU into plain modules (any slice; the reference the tests compare the packed model with).
- kimi_k25 (multimodal): the text config is `text_config`, text weights carry the `language_model.` prefix,
  and everything outside it (vision tower, projector) is skipped.
- MTP layers (`model.layers.{n}.*`, n >= num_hidden_layers) are skipped.
- The router's `mlp.gate.e_score_correction_bias` is fp32 whatever `dtype` is, and `mlp.gate.weight` keeps
  its stored float dtype (bf16 in Kimi / DeepSeek checkpoints, fp32 in HF copies): the router computes in
  fp32 from either (kernels/moe/router.py widens in registers, the torch path upcasts), so no fp32 copy is held.
- `slice_of(name)` makes a tensor-parallel rank read only the part it owns (`TensorSlice`), and `skip(name)`
  drops tensors it does not hold at all (expert parallel). Names are the logical weight names, i.e. the
  checkpoint names without the `language_model.` prefix, and `X.weight` for every companion of a quantized
  `X` (`X.weight_packed`, `X.weight_scale_inv`, ...); slices are of the logical (dequantized) 2-D weight.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddtree.models.checkpoint.files import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    CheckpointError,
    CheckpointFiles,
    checkpoint_weight_map,
)  # fmt: skip
from ddtree.models.deepseek_v3.config import DeepseekV3Config
from ddtree.models.deepseek_v3.model import DeepseekV3ForCausalLM
from ddtree.models.layers.attention import MLAAttentionBackend
from ddtree.models.parallel.shard_plan import TensorSlice  # the part of a weight one rank reads
from ddtree.models.quantization import Fp8BlockScheme, Int4PackScheme, QuantScheme, parse_quantization
from ddtree.models.quantization.packed_modules import PackedWeight, pack_modules

__all__ = [
    "INDEX_FILE", "SINGLE_FILE", "CheckpointError", "TensorSlice", "checkpoint_weight_map", "load_config",
    "load_target", "load_tensors", "read_config_dict",
]  # fmt: skip

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # fp32 unless stored otherwise (the weight)
ROUTER_WEIGHT = "mlp.gate.weight"  # kept in its stored float dtype
# Unmap the files before a read would take the bytes read through the open mappings past this: bounds
# the file pages resident beside the model (they count in the process's RSS while mapped).
MAX_MAPPED_BYTES = 64 << 20
READ_PART_BYTES = 32 << 20  # a plain tensor larger than this is read in row parts of at most this
TEXT_PREFIX = "language_model."  # kimi_k25: text weights are language_model.model.* / language_model.lm_head.*
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_COMPANION_RE = re.compile(r"\.weight(_scale_inv|_packed|_scale|_shape)$")


def read_config_dict(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        with open(file) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: invalid JSON ({err})") from err


def load_config(path: str | Path) -> DeepseekV3Config:
    """The text-model config of a checkpoint directory (or config.json path); kimi_k25 `text_config` handled."""
    return DeepseekV3Config.from_dict(read_config_dict(path))


def quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """quantization_config at the top level or (kimi_k25) inside text_config."""
    return raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")


def load_tensors(path: str | Path, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read just the named tensors (stored dtype) from a checkpoint directory; a kimi_k25 checkpoint's
    `language_model.` prefix is implied (ask for `lm_head.weight`)."""
    names = list(names)
    with CheckpointFiles(path) as files:
        stored = {n: n if n in files else TEXT_PREFIX + n for n in names}
        missing = [n for n, s in stored.items() if s not in files]
        if missing:
            raise CheckpointError(f"{_summary(missing)} not found in checkpoint {path}")
        return {n: files.read(s).to(device, copy=True) for n, s in stored.items()}  # owned, not the mapping


def load_target(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attention_backend: str | MLAAttentionBackend = "torch",
    *,
    build_model: Callable[[DeepseekV3Config], nn.Module] | None = None,
    slice_of: Callable[[str], TensorSlice | None] | None = None,
    skip: Callable[[str], bool] | None = None,
    dequantize: bool = False,
) -> nn.Module:
    """Build the model from `<path>/config.json` and load its weights.

    dtype None = the stored dtype of `model.embed_tokens.weight` (packed weights keep their stored dtypes,
    the router stays fp32). `build_model(config)` is called under torch.device("meta") (default
    `DeepseekV3ForCausalLM(config, attention_backend=...)`); its state_dict names must be checkpoint names
    and its shapes the sliced shapes. dequantize=True: quantized weights become plain float weights.
    """
    root = Path(path)
    raw = read_config_dict(root)
    config = DeepseekV3Config.from_dict(raw)
    scheme = parse_quantization(quantization_config(raw), str(root / "config.json"))
    with torch.device("meta"):
        model = (
            build_model(config) if build_model else DeepseekV3ForCausalLM(config, attention_backend=attention_backend)
        )
    skip = skip or (lambda name: False)

    with CheckpointFiles(root) as files:
        prefix = (
            TEXT_PREFIX if "text_config" in raw and any(n.startswith(TEXT_PREFIX) for n in files.weight_map) else ""
        )
        packed = pack_modules(model, scheme, prefix, files) if scheme is not None and not dequantize else {}
        expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        held = [n for n in expected if skip(_logical(n))]
        if held:
            raise CheckpointError(f"the model holds tensors that skip() excludes: {_summary(held)}")
        plan = _plan(files, config, prefix, scheme, expected, packed, skip)
        if dtype is None:
            stored = files.dtype(plan["model.embed_tokens.weight"].stored[0])
            if stored not in FLOAT_DTYPES:
                raise CheckpointError(f"model.embed_tokens.weight has stored dtype {stored}; pass dtype= explicitly")
            dtype = SAFETENSORS_DTYPES[stored][0]
        routers = {n: SAFETENSORS_DTYPES[files.dtype(p.stored[0])][0] for n, p in plan.items()
                   if n.endswith(ROUTER_WEIGHT) and files.dtype(p.stored[0]) in FLOAT_DTYPES}  # fmt: skip
        _materialize(model, device, dtype, routers)
        views = model.state_dict()  # aliases of the model's own tensors (experts: slots of the stacked ones)
        by_file: dict[Path, list[str]] = {}
        for name, p in plan.items():
            by_file.setdefault(p.file, []).append(name)
        for file in sorted(by_file):  # one shard at a time: its pages are unmapped after it
            for name in by_file[file]:
                logical = _logical(name)
                sl = slice_of(logical) if slice_of else None
                for part in _row_parts(plan[name], views[name], sl):
                    # Unmap first when this read would take the mapped pages past the bound.
                    if files.mapped_bytes and files.mapped_bytes + _nbytes(views[name], part) > MAX_MAPPED_BYTES:
                        files.close()
                    sub = sl if part is None else _narrow(sl, part)
                    want = expected[name] if part is None else (part.stop - part.start, *expected[name][1:])
                    value = _read(files, name, plan[name], want, sub, scheme, packed.get(logical))
                    # copy_ into the model's memory (converting the dtype): safetensors hands out views of
                    # the memory-mapped file, and the model must own its memory so the file can be unmapped
                    (views[name] if part is None else views[name][part]).copy_(value)
                    del value  # the last view would keep the mapping alive past close()
            files.close()
        del views
    _move_unsaved_buffers(model, device)
    return model.eval()


@dataclass(frozen=True)
class _Planned:
    stored: tuple[str, ...]  # checkpoint names (with any prefix); [0] is the weight (or weight_packed)
    file: Path  # the file holding stored[0]
    mode: str  # "plain" (as stored) | "packed" (one stored companion, as stored) | "dequantize"


def _plan(
    files: CheckpointFiles,
    config: DeepseekV3Config,
    prefix: str,
    scheme: QuantScheme | None,
    expected: dict[str, tuple[int, ...]],
    packed: dict[str, PackedWeight],
    skip: Callable[[str], bool],
) -> dict[str, _Planned]:
    """model name -> the checkpoint tensors that make it; fails on missing or unexpected tensors."""
    plan: dict[str, _Planned] = {}
    claimed: set[str] = set()
    missing: list[str] = []
    for name, shape in expected.items():
        module = name.rpartition(".")[0]
        if _logical(name) in packed:
            mode, local = "packed", (name,)
        elif (
            scheme is not None and name.endswith(".weight") and len(shape) == 2
            and scheme.quantizes((prefix + module, module))
        ):  # fmt: skip
            mode, local = "dequantize", scheme.stored_names(name)
        else:
            mode, local = "plain", (name,)
        stored = tuple(prefix + n for n in local)
        claimed.update(stored)
        missing += [n for n in stored if n not in files]
        if stored[0] in files:
            plan[name] = _Planned(stored, files.file_of(stored[0]), mode)
    unexpected = []
    for n in files.weight_map:
        if n in claimed or not n.startswith(prefix):  # outside the text model: vision tower, projector
            continue
        local = n[len(prefix) :]
        if _is_mtp(local, config.num_hidden_layers) or skip(_logical(local)):
            continue
        if 0 in files.shape(n):  # a zero-size tensor holds no weights (transformers saves n_shared_experts 0 so)
            continue
        unexpected.append(n)
    if missing or unexpected:
        source = _source_file(files)
        parts = []
        if missing:
            parts.append(f"missing tensors: {_summary(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_summary(unexpected)}")
        scheme_note = f" (quantization: {scheme.name})" if scheme else ""
        raise CheckpointError(f"checkpoint {source} does not match the model{scheme_note}; " + "; ".join(parts))
    return plan


def _row_parts(p: _Planned, view: torch.Tensor, sl: TensorSlice | None) -> list[slice | None]:
    """Row ranges of a plain tensor of more than READ_PART_BYTES, read one after the other so that the
    mapped pages and safetensors' copy of one read stay small (embed_tokens and lm_head are 290 MB per
    rank at Kimi width, TP 8); [None] = read it whole (packed and quantized tensors are per expert or
    per projection, and their slices must cut on whole blocks)."""
    if p.mode != "plain" or view.dim() < 2 or view.nbytes <= READ_PART_BYTES or (sl is not None and sl.dim != 0):
        return [None]  # a column slice (row-parallel o_proj / down_proj) is 1/N of each row: small
    rows = max(1, READ_PART_BYTES // (view.nbytes // view.shape[0]))
    return [slice(a, min(a + rows, view.shape[0])) for a in range(0, view.shape[0], rows)]


def _nbytes(view: torch.Tensor, part: slice | None) -> int:
    return view.nbytes if part is None else (part.stop - part.start) * (view.nbytes // view.shape[0])


def _narrow(sl: TensorSlice | None, part: slice) -> TensorSlice:
    """The checkpoint rows of model rows `part` (within the rank's own row slice when it has one)."""
    base = 0 if sl is None else sl.start
    return TensorSlice(0, base + part.start, base + part.stop)


def _source_file(files: CheckpointFiles) -> Path:
    index = files.root / INDEX_FILE
    return index if index.exists() else files.root / SINGLE_FILE


def _read(
    files: CheckpointFiles,
    name: str,
    p: _Planned,
    want: tuple[int, ...],
    sl: TensorSlice | None,
    scheme: QuantScheme | None,
    packed: PackedWeight | None,
) -> torch.Tensor:
    head = p.stored[0]
    logical_name = _logical(name)
    if p.mode == "plain":
        logical, model_shape = files.shape(head), want
        if files.dtype(head) not in FLOAT_DTYPES:
            hint = " (not covered by quantization_config)" if scheme else " (no quantization_config)"
            raise CheckpointError(f"{files.file_of(head)}: tensor {head} is stored as {files.dtype(head)}{hint}")
    else:
        weight = _logical(head)  # the stored `X.weight` name, prefix included
        logical = scheme.logical_shape(files, weight)
        model_shape = want if packed is None else (packed.out_features, packed.in_features)
    got = list(logical)
    if sl is not None:
        if not (0 <= sl.dim < len(logical)) or not (0 <= sl.start < sl.stop <= logical[sl.dim]):
            raise CheckpointError(
                f"{files.file_of(head)}: tensor {logical_name}: slice {sl} out of checkpoint shape {got}"
            )
        got[sl.dim] = sl.stop - sl.start
    if tuple(got) != tuple(model_shape):
        sliced = "" if sl is None else f" sliced by {sl} to {got}"
        raise CheckpointError(
            f"{files.file_of(head)}: tensor {logical_name}: checkpoint shape {list(logical)}{sliced} != model "
            f"shape {list(model_shape)}"
        )
    full = [slice(0, n) for n in logical]
    if sl is not None:
        full[sl.dim] = slice(sl.start, sl.stop)
    rows, cols = full[0], (full[1] if len(full) > 1 else None)
    if p.mode == "plain":
        if sl is None:
            return files.read(head)
        return files.read(head, rows, cols if sl.dim == 1 else None)
    leaf = name.rpartition(".")[2]
    if p.mode == "packed":
        if isinstance(scheme, Fp8BlockScheme):
            value = scheme.read_packed(files, weight, leaf, rows, cols, logical)
        else:
            value = scheme.read_packed(files, weight, leaf, rows, cols, packed.group_size, logical)
        if tuple(value.shape) != want:
            raise CheckpointError(
                f"{files.file_of(head)}: tensor {head}: read {list(value.shape)} != model {list(want)}"
            )
        return value
    if isinstance(scheme, Fp8BlockScheme):
        return scheme.read(files, weight, rows, cols)
    assert isinstance(scheme, Int4PackScheme)
    group = scheme.group_of((weight.removesuffix(".weight"), name.removesuffix(".weight")))
    return scheme.read(files, weight, rows, cols, group.group_size, logical[1])


def _logical(name: str) -> str:
    """`X.weight` for a quantized weight's companions (`X.weight_packed`, `X.weight_scale_inv`, ...)."""
    return _COMPANION_RE.sub(".weight", name)


def _materialize(
    model: nn.Module, device: str | torch.device, dtype: torch.dtype, kept: dict[str, torch.dtype] | None = None
) -> None:
    """Allocate every saved tensor still on meta at its final device and dtype (uninitialised; filled next):
    packed leaves keep the dtype their module chose, `kept` (the routers' weights) theirs, the router's bias
    fp32, other floats `dtype`."""
    for module_name, module in model.named_modules():
        keep = getattr(module, "PACKED_LEAVES", ())
        for store in (module._parameters, module._buffers):
            for leaf, t in store.items():
                if t is None or not t.is_meta or leaf in module._non_persistent_buffers_set:
                    continue
                qualified = f"{module_name}.{leaf}"
                if leaf in keep or not t.is_floating_point():
                    want = t.dtype
                else:
                    want = torch.float32 if qualified.endswith(FP32_SUFFIXES) else dtype
                    want = (kept or {}).get(qualified, want)
                new = torch.empty(t.shape, dtype=want, device=device)
                store[leaf] = nn.Parameter(new, requires_grad=False) if store is module._parameters else new


def _is_mtp(name: str, num_layers: int) -> bool:
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def _move_unsaved_buffers(model: nn.Module, device: str | torch.device) -> None:
    """Non-persistent buffers (RoPE inv_freq, built on the CPU) follow the weights; none may stay on meta."""
    for module_name, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.is_meta:
                raise CheckpointError(f"buffer {module_name}.{leaf} is not in the checkpoint and was built on meta")
            module._buffers[leaf] = buf.to(device)


def _summary(names: list[str], first: int = 5) -> str:
    shown = ", ".join(names[:first])
    more = f" (+{len(names) - first} more)" if len(names) > first else ""
    return f"{len(names)} [{shown}{more}]"
