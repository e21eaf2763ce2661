"""Give a model (built on the meta device, before loading) packed modules where its checkpoint is quantized.

`pack_modules(model, scheme, prefix, files)` replaces every nn.Linear the scheme quantizes by an
`Int4Linear` / `Fp8Linear` of the same (local, sliced) shape, and every routed-expert projection
(`StackedProjection`, one per layer and projection) whose experts the scheme quantizes by an int4 / fp8
one. FP8 (`quant_method: fp8`) quantizes every projection not ignored; INT4 (compressed-tensors) the
targeted ones, which in the Kimi checkpoints are the routed experts only. Their state-dict names then are
the stored ones (`X.weight_packed` / `X.weight_scale` / `X.weight_shape`, or fp8 `X.weight` +
`X.weight_scale_inv`), and the loader fills them with the stored bytes as they are.

A merged linear (merged_linear.py: the MLP's gate_up_proj, MLA's fused_qkv_a_proj_with_mqa) stays one
GEMM when all its parts are quantized alike and the format lets their rows be stacked: INT4 always (rows
are independent), FP8 when every part but the last fills whole row blocks; plain parts stay merged too.
Otherwise (FP8 with ragged part rows, or parts in different formats) it is split back into one module per
part, each packed or plain as the scheme says.

It returns, per logical weight name (`X.weight`; for experts `...mlp.experts.{g}.{proj}.weight`, g global),
the `PackedWeight` the model holds, which the loader uses to slice and check what it reads.
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.models.checkpoint.files import SAFETENSORS_DTYPES, CheckpointError, CheckpointFiles
from ddtree.models.deepseek_v3.moe_experts import PROJECTIONS, StackedExperts, StackedProjection
from ddtree.models.layers.merged_linear import can_merge_fp8, merged_parts, split_merged
from ddtree.models.quantization.formats import BY_NAME, PackedWeight
from ddtree.models.quantization.fp8_block import Fp8BlockScheme
from ddtree.models.quantization.int4_pack import Int4PackScheme

__all__ = ["PackedWeight", "pack_modules"]


def pack_modules(
    model: nn.Module, scheme: Fp8BlockScheme | Int4PackScheme, prefix: str, files: CheckpointFiles
) -> dict[str, PackedWeight]:
    packed: dict[str, PackedWeight] = {}
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            parts = merged_parts(parent, leaf) if isinstance(module, nn.Linear) else None
            if parts is not None:
                _pack_merged(parent, parent_name, leaf, module, parts, scheme, prefix, files, packed)
            elif isinstance(module, nn.Linear):
                fmt = _format(scheme, prefix, name, *module.weight.shape, files)  # [N, K] as built (sliced)
                if fmt is not None:
                    parent, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(parent) if parent else model, leaf, _linear(module, *fmt))
                    packed[name + ".weight"] = fmt[0]
            elif isinstance(module, StackedExperts):
                for proj_name, proj in zip(PROJECTIONS, module.projections(), strict=True):
                    experts = [f"{name}.{module.first + i}.{proj_name}" for i in range(module.num_local)]
                    fmts = [_format(scheme, prefix, e, proj.out_features, proj.in_features, files) for e in experts]
                    if all(f is None for f in fmts):
                        continue
                    if any(f is None for f in fmts) or len({f[0] for f in fmts}) > 1:
                        raise CheckpointError(
                            f"{name}.*.{proj_name}: the quantization_config gives the experts of one layer "
                            "different formats; they are stacked in one tensor and must share one"
                        )
                    w, scale_dtype = fmts[0]
                    stacked = StackedProjection(
                        module.num_local, w.out_features, w.in_features, w.kind, w.group_size, w.block, scale_dtype
                    )
                    module.set_projection(proj_name, stacked)
                    packed.update((e + ".weight", w) for e in experts)
    return packed


def _pack_merged(
    parent: nn.Module,
    parent_name: str,
    leaf: str,
    merged: nn.Linear,
    parts: tuple[tuple[str, int], ...],
    scheme,
    prefix: str,
    files: CheckpointFiles,
    packed: dict[str, PackedWeight],
) -> None:
    """Pack a merged linear whole (one GEMM), or split it into its parts when the formats do not allow it."""
    K = merged.in_features
    names = [f"{parent_name}.{part}" if parent_name else part for part, _ in parts]
    fmts = [_format(scheme, prefix, n, rows, K, files) for n, (_, rows) in zip(names, parts, strict=True)]
    if all(f is None for f in fmts):
        return
    kinds = {None if f is None else (f[0].kind, f[0].group_size, f[0].block, f[1]) for f in fmts}
    first, scale_dtype = fmts[0] if fmts[0] is not None else (None, None)
    if len(kinds) == 1 and (not first.fmt.block_scaled or can_merge_fp8(parts, first.block[0])):
        total = sum(rows for _, rows in parts)
        new = _linear(merged, PackedWeight(first.kind, total, K, first.group_size, first.block), scale_dtype)
        if first.fmt.stores_shape:  # not in the checkpoint as one tensor (each part has its own): built here
            new.weight_shape = torch.tensor([total, K], dtype=torch.int32, device="cpu")
        setattr(parent, leaf, new)
    else:
        by_part = {part: f for (part, _), f in zip(parts, fmts, strict=True)}

        def make_part(part: str, rows: int) -> nn.Module:
            plain = nn.Linear(K, rows, bias=merged.bias is not None)
            return plain if by_part[part] is None else _linear(plain, *by_part[part])

        split_merged(parent, leaf, make_part)
    packed.update((n + ".weight", f[0]) for n, f in zip(names, fmts, strict=True) if f is not None)


def _format(
    scheme, prefix: str, module: str, out_features: int, in_features: int, files: CheckpointFiles
) -> tuple[PackedWeight, torch.dtype] | None:
    """(format, scale dtype as stored: bf16 when not a float or not there) of `module` when the scheme
    quantizes it, else None."""
    names = (prefix + module, module)
    if not scheme.quantizes(names):
        return None
    group, block = scheme.params(names)
    fmt = scheme.weight_format
    scale = f"{prefix}{module}.{fmt.leaves[1]}"
    stored = SAFETENSORS_DTYPES.get(files.dtype(scale), (torch.bfloat16,))[0] if scale in files else torch.bfloat16
    scale_dtype = stored if stored.is_floating_point else torch.bfloat16
    return PackedWeight(fmt.name, out_features, in_features, group, block), scale_dtype


def _linear(old: nn.Linear, w: PackedWeight, scale_dtype: torch.dtype) -> nn.Module:
    return BY_NAME[w.kind].linear(w, old.bias is not None, scale_dtype)
