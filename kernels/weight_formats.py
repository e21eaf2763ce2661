"""The weight formats as objects, registered in one place: what depends on how a weight is stored asks its
format (a property or a method of the object), never compares the format's name.

A format is known by the name the kernels give it (`ExpertWeights.kind`, `StackedProjection.kind`, the keys
of the fused MoE's tile tables): "bf16", "int4", "fp8"; `weight_format(name)` looks it up. A quantized one
also names the checkpoint's `quantization_config.quant_method` that stores it; the models' side of the
registry (models/quantization/formats.py) binds that name to the scheme that reads such a checkpoint and the
packed linear that holds it. Adding a format: a class here, its scheme there, its kernel branch.

- bf16: `weight` float [N, K] (the model's dtype); 2 bytes an element; dense GEMM torch; fused MoE KIND 0.
- int4 (quant_method `compressed-tensors`, pack-quantized): `weight_packed` int32 [N, ceil(K/8)],
  `weight_scale` [N, ceil(K/g)] (bf16), `weight_shape` int32 [2]; 0.5 + 2/g bytes an element; dense GEMM
  `int4_gemm` (reference `int4_gemm_reference`); KIND 1.
- fp8 (quant_method `fp8`, e4m3 with block scales): `weight` float8_e4m3fn [N, K], `weight_scale_inv` fp32
  [ceil(N/bn), ceil(K/bk)]; 1 + 4/(bn·bk) bytes an element; dense GEMM `fp8_block_gemm` (reference
  `fp8_block_gemm_reference`); KIND 2.

The arithmetic itself (pack, unpack, dequantize) is quant_formats.py; a stacked weight is [E, N, K] with
the same layout per expert (moe/weights.py). This module imports no triton.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ddtree.kernels.quant_formats import (
    PACK,
    dequantize_fp8_block,
    dequantize_int4,
    quantize_fp8_block,
    quantize_int4_group,
)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One storage format. Per-weight parameters (an INT4 group size, an FP8 scale block) are arguments of
    the methods, not fields: one object per format."""

    name: str  # the kernels' name of it
    kernel_id: int  # the fused MoE kernel's KIND constexpr
    quant_method: str | None  # quantization_config.quant_method of a checkpoint storing it; None: unquantized
    leaves: tuple[str, ...]  # the tensors of one weight `X` as stored, X.{leaf}: [0] the weight, [1] its scale
    tile_bytes: float  # an element of a fused-MoE weight tile as loaded (INT4: packed words)
    moe_block_k: int  # the fused MoE's default K tile (quantized: a long K tile amortises the scale loads)
    gemm: str | None = None  # the dense GEMM kernel, a ddtree.kernels function (packed_linear.cuda_kernel)
    reference: str | None = None  # its torch reference in ddtree.kernels.gemm.dense_reference
    # fused MoE: the weight tile is converted to the dot's width in registers (one more tile of shared memory)
    dequantizes_tiles: bool = False
    # x and h are quantized to e4m3 per row and K block inside the GEMMs: h is kept fp32, the dots are 8-bit
    # (K tile >= 32, TF32 precision), the activation tile is converted once more, and results differ from the
    # float reference by the activations' rounding
    quantizes_activations: bool = False
    block_scaled: bool = False  # scales per [bn, bk] block of W: a K tile lies in one block, row parts stack on
    # whole row blocks only
    grouped: bool = False  # scales per group of `group_size` columns of a row (the weight's group_size is set)
    min_capability: tuple[int, int] = (0, 0)  # the CUDA compute capability the kernels need

    @property
    def packed(self) -> bool:
        """Stored quantized (words / 8-bit values and scales, kept as stored), not as a float tensor."""
        return self.quant_method is not None

    @property
    def stores_shape(self) -> bool:
        """A `weight_shape` leaf [N, K] travels with the weight (a merged weight builds its own)."""
        return "weight_shape" in self.leaves

    def check(self, weight: torch.Tensor, scale: torch.Tensor | None, N: int, K: int, group_size: int,
              block: tuple[int, int]) -> None:  # fmt: skip
        """ValueError unless weight [E, N, K'] and scale are exactly this format's stacked layout."""
        raise NotImplementedError

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor | None, in_features: int, group_size: int,
                   block: tuple[int, int]) -> torch.Tensor:  # fmt: skip
        """fp32 [..., N, K] of stored weight [..., N, K'] (and its scales [..., ., .])."""
        raise NotImplementedError

    def quantize(
        self, w: torch.Tensor, group_size: int, block: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float [..., N, K] -> (weight, scale) as stored (per matrix; what a quantized checkpoint holds)."""
        raise NotImplementedError

    def empty(self, E: int, N: int, K: int, group_size: int, block: tuple[int, int],
              scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
        """Uninitialised stacked leaves {leaf: [E, ...]} of E experts' [N, K] weights (packed formats)."""
        raise NotImplementedError

    def stored_bytes(self, rows: int, cols: int, group_size: int, block: tuple[int, int]) -> tuple[int, int]:
        """(bytes of a stored [rows, cols] weight incl. its scales, of them the bytes every holder keeps whole)."""
        raise NotImplementedError

    def scale_bytes(self, rows: int, cols: int, group_size: int, block: tuple[int, int]) -> int:
        """Bytes of the scales of a [rows, cols] weight (bf16 group scales, fp32 block scales)."""
        return 0

    def read_bytes(self, rows: int, cols: int, group_size: int, block: tuple[int, int]) -> float:
        """Bytes a kernel reads for a [rows, cols] weight: its elements as loaded and their scales."""
        return rows * cols * self.tile_bytes + self.scale_bytes(rows, cols, group_size, block)

    def params_key(self, group_size: int, block: tuple[int, int]) -> str:
        """The per-weight parameters in a table key: 'g32', 'b128x128', '-'; params_of is its inverse."""
        return "-"

    def params_of(self, key: str) -> tuple[int, tuple[int, int]]:
        """(group size, block) of params_key's string."""
        return 0, (0, 0)

    def label(self, group_size: int = 0, block: tuple[int, int] = (128, 128)) -> str:
        """How reports name a weight in this format: bf16, int4-g32, fp8-128x128."""
        return self.name

    def describe(self, group_size: int, block: tuple[int, int]) -> str:
        """The per-weight parameters, for a module's repr: '', ', group_size=32', ', block=[128, 128]'."""
        return ""

    def activation_bytes(self, loaded: int, wide: bool) -> int:
        """An activation element as the fused MoE's tiles hold it: the dot's width (4 wide, else 2), or as
        loaded when the format quantizes the activations in registers."""
        return loaded if self.quantizes_activations else 4 if wide else 2


class FloatFormat(WeightFormat):
    def check(self, weight, scale, N, K, group_size, block) -> None:
        _expect(weight, FLOAT_DTYPES, (weight.shape[0], N, K), "weight")
        if scale is not None:
            raise ValueError(f"expert weights ({self.name}): no scale expected")

    def dequantize(self, weight, scale, in_features, group_size, block) -> torch.Tensor:
        return weight.float()

    def quantize(self, w, group_size, block):
        return w, None

    def stored_bytes(self, rows, cols, group_size, block) -> tuple[int, int]:
        return 2 * rows * cols, 0


class Int4PackFormat(WeightFormat):
    def check(self, weight, scale, N, K, group_size, block) -> None:
        if group_size <= 0 or group_size % PACK:
            raise ValueError(
                f"expert weights (int4): group_size must be a positive multiple of {PACK}, got {group_size}"
            )
        E = weight.shape[0]
        _expect(weight, (torch.int32,), (E, N, -(-K // PACK)), "weight")
        if scale is None:
            raise ValueError("expert weights (int4): scale is required")
        _expect(scale, FLOAT_DTYPES, (E, N, -(-K // group_size)), "scale")

    def dequantize(self, weight, scale, in_features, group_size, block) -> torch.Tensor:
        return dequantize_int4(weight, scale, group_size, in_features)

    def quantize(self, w, group_size, block):
        parts = [quantize_int4_group(m, group_size)[:2] for m in w.reshape(-1, *w.shape[-2:])]
        return _stack(parts, w.shape[:-2])

    def empty(self, E, N, K, group_size, block, scale_dtype) -> dict[str, torch.Tensor]:
        if group_size <= 0 or group_size % PACK:
            raise ValueError(f"int4 experts: group_size must be a positive multiple of {PACK}, got {group_size}")
        return {
            "weight_packed": torch.empty(E, N, -(-K // PACK), dtype=torch.int32),
            "weight_scale": torch.empty(E, N, -(-K // group_size), dtype=scale_dtype),
            "weight_shape": torch.tensor([[N, K]] * E, dtype=torch.int32).view(E, 2),
        }

    def stored_bytes(self, rows, cols, group_size, block) -> tuple[int, int]:
        # int32 words, bf16 scales, and the int32 [2] weight_shape every holder keeps whole
        return rows * math.ceil(cols / PACK) * 4 + self.scale_bytes(rows, cols, group_size, block) + 8, 8

    def scale_bytes(self, rows, cols, group_size, block) -> int:
        return rows * math.ceil(cols / group_size) * 2

    def params_key(self, group_size, block) -> str:
        return f"g{group_size}"

    def params_of(self, key: str) -> tuple[int, tuple[int, int]]:
        return int(key[1:]), (0, 0)

    def label(self, group_size: int = 0, block=(128, 128)) -> str:
        return f"{self.name}-g{group_size}"

    def describe(self, group_size, block) -> str:
        return f", group_size={group_size}"


class Fp8BlockFormat(WeightFormat):
    def check(self, weight, scale, N, K, group_size, block) -> None:
        bn, bk = block
        E = weight.shape[0]
        _expect(weight, (torch.float8_e4m3fn,), (E, N, K), "weight")
        if scale is None:
            raise ValueError("expert weights (fp8): scale (weight_scale_inv) is required")
        _expect(scale, (torch.float32,), (E, -(-N // bn), -(-K // bk)), "scale")

    def dequantize(self, weight, scale, in_features, group_size, block) -> torch.Tensor:
        return dequantize_fp8_block(weight, scale, block)

    def quantize(self, w, group_size, block):
        parts = [quantize_fp8_block(m, block) for m in w.reshape(-1, *w.shape[-2:])]
        return _stack(parts, w.shape[:-2])

    def empty(self, E, N, K, group_size, block, scale_dtype) -> dict[str, torch.Tensor]:
        bn, bk = block
        return {
            "weight": torch.empty(E, N, K, dtype=torch.float8_e4m3fn),
            "weight_scale_inv": torch.empty(E, -(-N // bn), -(-K // bk), dtype=torch.float32),
        }

    def stored_bytes(self, rows, cols, group_size, block) -> tuple[int, int]:
        return rows * cols + self.scale_bytes(rows, cols, group_size, block), 0

    def scale_bytes(self, rows, cols, group_size, block) -> int:
        return math.ceil(rows / block[0]) * math.ceil(cols / block[1]) * 4

    def params_key(self, group_size, block) -> str:
        return f"b{block[0]}x{block[1]}"

    def params_of(self, key: str) -> tuple[int, tuple[int, int]]:
        bm, bn = (int(v) for v in key[1:].split("x"))
        return 0, (bm, bn)

    def label(self, group_size: int = 0, block=(128, 128)) -> str:
        return f"{self.name}-{block[0]}x{block[1]}"

    def describe(self, group_size, block) -> str:
        return f", block={list(block)}"


BF16 = FloatFormat("bf16", kernel_id=0, quant_method=None, leaves=("weight",), tile_bytes=2, moe_block_k=64)
INT4_PACK = Int4PackFormat(
    "int4", kernel_id=1, quant_method="compressed-tensors", leaves=("weight_packed", "weight_scale", "weight_shape"),
    tile_bytes=0.5, moe_block_k=128, gemm="int4_gemm", reference="int4_gemm_reference", dequantizes_tiles=True,
    grouped=True,
)  # fmt: skip
FP8_BLOCK = Fp8BlockFormat(
    "fp8", kernel_id=2, quant_method="fp8", leaves=("weight", "weight_scale_inv"), tile_bytes=1, moe_block_k=128,
    gemm="fp8_block_gemm", reference="fp8_block_gemm_reference", quantizes_activations=True, block_scaled=True,
    min_capability=(8, 9),  # Triton has no e4m3 before Ada
)  # fmt: skip

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (BF16, INT4_PACK, FP8_BLOCK)}
BY_QUANT_METHOD: dict[str, WeightFormat] = {f.quant_method: f for f in FORMATS.values() if f.quant_method}
BY_KERNEL_ID: dict[int, WeightFormat] = {f.kernel_id: f for f in FORMATS.values()}


def weight_format(name: str) -> WeightFormat:
    """The format the kernels call `name`; ValueError naming the known ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, got {name!r}")
    return fmt


def _stack(parts: list, lead: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return q.view(*lead, *q.shape[1:]).contiguous(), s.view(*lead, *s.shape[1:]).contiguous()


def _expect(t: torch.Tensor, dtypes, shape, what: str) -> None:
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"expert weights: {what} dtype must be {names}, got {str(t.dtype).removeprefix('torch.')}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"expert weights: {what} must have shape {list(shape)}, got {list(t.shape)}")
