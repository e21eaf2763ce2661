"""The models' side of the weight-format registry, keyed by the checkpoint's name for a format.

A checkpoint names its format by `quantization_config.quant_method`; each entry binds that name to the
format object (ddtree.kernels.weight_formats: layout, dequantize, pack, kernels, bytes), the scheme that
reads such a checkpoint (which modules are quantized, stored names, slices) and the packed linear that holds
one of its dense weights. `parse_quantization` (this package's `__init__`) and `pack_modules` look formats up
here; nothing else names one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.kernels.weight_formats import BY_QUANT_METHOD, FP8_BLOCK, INT4_PACK, WeightFormat
from ddtree.models.layers.packed_linear import Fp8Linear, Int4Linear
from ddtree.models.quantization.fp8_block import Fp8BlockScheme
from ddtree.models.quantization.int4_pack import Int4PackScheme


@dataclass(frozen=True)
class PackedWeight:
    """A quantized weight as the model holds it (the loader slices and checks what it reads by it)."""

    kind: str  # the format's name (weight_formats.FORMATS)
    out_features: int  # N of the model's (local) weight
    in_features: int  # K
    group_size: int = 0  # int4
    block: tuple[int, int] = (128, 128)  # fp8

    @property
    def fmt(self) -> WeightFormat:
        return BY_NAME[self.kind].weight


@dataclass(frozen=True)
class CheckpointFormat:
    weight: WeightFormat
    scheme: type[Fp8BlockScheme] | type[Int4PackScheme]  # .from_config(quantization_config, source)
    linear: Callable[[PackedWeight, bool, torch.dtype], nn.Module]  # (weight, bias, scale dtype) -> packed linear


CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {
    FP8_BLOCK.quant_method: CheckpointFormat(
        FP8_BLOCK, Fp8BlockScheme, lambda w, bias, _: Fp8Linear(w.in_features, w.out_features, w.block, bias=bias)
    ),
    INT4_PACK.quant_method: CheckpointFormat(
        INT4_PACK,
        Int4PackScheme,
        lambda w, bias, scale_dtype: Int4Linear(
            w.in_features, w.out_features, w.group_size, bias=bias, scale_dtype=scale_dtype
        ),
    ),
}
assert set(CHECKPOINT_FORMATS) == set(BY_QUANT_METHOD)  # every quantized format of the kernels can be loaded
BY_NAME: dict[str, CheckpointFormat] = {f.weight.name: f for f in CHECKPOINT_FORMATS.values()}
QUANT_METHODS = tuple(CHECKPOINT_FORMATS)
