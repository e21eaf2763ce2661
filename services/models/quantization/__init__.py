"""Weight formats of quantized checkpoints: read packed as stored (packed_modules.py), or dequantized.

`parse_quantization(quantization_config, source)` returns the scheme for a config's
`quantization_config` (None for an unquantized checkpoint): `Fp8BlockScheme` (quant_method fp8, 128x128
block scales) or `Int4PackScheme` (quant_method compressed-tensors, INT4 pack-quantized groups), as formats.py registers
them. Any other method raises `CheckpointError` naming `source` (the config file).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddtree.models.checkpoint.files import CheckpointError
from ddtree.models.quantization.formats import CHECKPOINT_FORMATS, QUANT_METHODS
from ddtree.models.quantization.fp8_block import Fp8BlockScheme, dequantize_fp8_block, quantize_fp8_block
from ddtree.models.quantization.int4_pack import Int4PackScheme, quantize_int4_group, unpack_int4

QuantScheme = Fp8BlockScheme | Int4PackScheme

__all__ = [
    "QUANT_METHODS", "Fp8BlockScheme", "Int4PackScheme", "QuantScheme", "dequantize_fp8_block", "parse_quantization",
    "quantize_fp8_block", "quantize_int4_group", "unpack_int4",
]  # fmt: skip


def parse_quantization(qc: Mapping[str, Any] | None, source: str) -> QuantScheme | None:
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    fmt = CHECKPOINT_FORMATS.get(method) if isinstance(method, str) else None
    if fmt is not None:
        return fmt.scheme.from_config(qc, source)
    raise CheckpointError(
        f"{source}: quantization_config.quant_method {method!r} is not supported; expected one of {QUANT_METHODS}"
    )
