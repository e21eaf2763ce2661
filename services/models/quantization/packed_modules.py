"""Give a model (built on the meta device, before loading) packed modules where its checkpoint is quantized.

`pack_modules(model, scheme, prefix, files)` replaces every nn.Linear the scheme quantizes by an
`Int4Linear` / `Fp8Linear` of the same (local, sliced) shape, and every routed-expert projection
(`StackedProjection`, one per layer and projection) whose experts the scheme quantizes by an int4 / fp8
one. FP8 (`quant_method: fp8`) quantizes every projection not ignored; INT4 (compressed-tensors) the
targeted ones, which in the Kimi checkpoints are the routed experts only. Their state-dict names then are
the stored ones (`X.weight_packed` / `X.weight_scale` / `X.weight_shape`, or fp8 `X.weight` +
`X.weight_scale_inv`), and the loader fills them with the stored bytes as they are.

It returns, per logical weight name (`X.weight`; for experts `...mlp.experts.{g}.{proj}.weight`, g global),
the `PackedWeight` the model holds, which the loader uses to slice and check what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..checkpoint_files import SAFETENSORS_DTYPES, CheckpointError, CheckpointFiles
from ..moe_experts import PROJECTIONS, StackedExperts, StackedProjection
from ..packed_linear import Fp8Linear, Int4Linear
from .fp8_block import Fp8BlockScheme
from .int4_pack import Int4PackScheme


@dataclass(frozen=True)
class PackedWeight:
    kind: str  # "int4" | "fp8"
    out_features: int  # N of the model's (local) weight
    in_features: int  # K
    group_size: int = 0  # int4
    block: tuple[int, int] = (128, 128)  # fp8


def pack_modules(
    model: nn.Module, scheme: Fp8BlockScheme | Int4PackScheme, prefix: str, files: CheckpointFiles
) -> dict[str, PackedWeight]:
    packed: dict[str, PackedWeight] = {}
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
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


def _format(
    scheme, prefix: str, module: str, out_features: int, in_features: int, files: CheckpointFiles
) -> tuple[PackedWeight, torch.dtype] | None:
    """(format, int4 scale dtype) of `module` when the scheme quantizes it, else None."""
    names = (prefix + module, module)
    if not scheme.quantizes(names):
        return None
    if isinstance(scheme, Fp8BlockScheme):
        return PackedWeight("fp8", out_features, in_features, block=scheme.block), torch.float32
    group = scheme.group_of(names).group_size
    scale = prefix + module + ".weight_scale"
    stored = SAFETENSORS_DTYPES.get(files.dtype(scale), (torch.bfloat16,))[0] if scale in files else torch.bfloat16
    scale_dtype = stored if stored.is_floating_point else torch.bfloat16
    return PackedWeight("int4", out_features, in_features, group_size=group), scale_dtype


def _linear(old: nn.Linear, w: PackedWeight, scale_dtype: torch.dtype) -> nn.Module:
    bias = old.bias is not None
    if w.kind == "fp8":
        return Fp8Linear(w.in_features, w.out_features, w.block, bias=bias)
    return Int4Linear(w.in_features, w.out_features, w.group_size, bias=bias, scale_dtype=scale_dtype)
