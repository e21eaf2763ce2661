"""FP8 e4m3 weights with block scales (DeepSeek-V3/R1, Kimi K2 FP8; docs/design.md §6).

quantization_config: `{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}`
plus an optional skip list (`modules_to_not_convert`, or `ignored_layers` / `ignore`). Each quantised Linear
`X` stores `X.weight` float8_e4m3fn [M, N] and `X.weight_scale_inv` float32 [ceil(M/bm), ceil(N/bn)]:

    W[i, j] = float(q[i, j]) · scale_inv[i // bm, j // bn]      (ragged edge blocks use the same scale)

Quantised: every projection (`*_proj`, `kv_a_proj_with_mqa`) not skipped; lm_head, the embedding, norms and the router stay in
the stored high precision (transformers also never converts the output embedding).

Two ways to read a slice of rows/cols: `read` dequantizes it (fp32; any bounds: only those rows/cols of
`X.weight` and the scale blocks that cover them are read); `read_packed` returns the stored fp8 values or
scales of it as they are, for the packed modules, and needs bounds on whole blocks (or the edge).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ddtree.kernels.quant_formats import FP8_MAX, dequantize_fp8_block, quantize_fp8_block
from ddtree.kernels.weight_formats import FP8_BLOCK, WeightFormat
from ddtree.models.checkpoint.files import CheckpointError, CheckpointFiles
from ddtree.models.quantization.names import any_matches, is_projection

__all__ = ["FP8_DTYPES", "FP8_MAX", "Fp8BlockScheme", "dequantize_fp8_block", "quantize_fp8_block"]

FP8_DTYPES = ("F8_E4M3",)


@dataclass(frozen=True)
class Fp8BlockScheme:
    block: tuple[int, int] = (128, 128)
    ignore: tuple[str, ...] = ()
    name: str = FP8_BLOCK.quant_method
    weight_format: ClassVar[WeightFormat] = FP8_BLOCK

    @classmethod
    def from_config(cls, qc: Mapping[str, Any], source: str) -> Fp8BlockScheme:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{source}: quantization_config.fmt {fmt!r} is not supported; expected 'e4m3'")
        block = qc.get("weight_block_size")
        if block is None or len(block) != 2 or min(block) <= 0:
            raise CheckpointError(f"{source}: quantization_config.weight_block_size {block!r} must be [rows, cols]")
        ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or qc.get("ignore") or ()
        return cls(block=(int(block[0]), int(block[1])), ignore=tuple(ignore))

    def quantizes(self, names: tuple[str, ...]) -> bool:
        """names: the module as stored and as named in the model (e.g. '...self_attn.q_b_proj')."""
        return is_projection(names[-1]) and not any_matches(names, self.ignore)

    def params(self, names: tuple[str, ...]) -> tuple[int, tuple[int, int]]:
        """(group size, scale block) of a weight it quantizes."""
        return 0, self.block

    def stored_names(self, weight: str) -> tuple[str, ...]:
        return weight, weight + "_scale_inv"

    def logical_shape(self, files: CheckpointFiles, weight: str) -> tuple[int, ...]:
        shape = files.shape(weight)
        dtype = files.dtype(weight)
        if dtype not in FP8_DTYPES:
            raise CheckpointError(f"{files.file_of(weight)}: tensor {weight} is {dtype}, expected F8_E4M3 (fp8)")
        scale = weight + "_scale_inv"
        want = tuple(-(-n // b) for n, b in zip(shape, self.block, strict=True))
        if files.shape(scale) != want:
            raise CheckpointError(
                f"{files.file_of(scale)}: tensor {scale} has shape {list(files.shape(scale))}, expected "
                f"{list(want)} for a {list(shape)} weight in {list(self.block)} blocks"
            )
        return shape

    def read(self, files: CheckpointFiles, weight: str, rows: slice, cols: slice) -> torch.Tensor:
        """Dequantised fp32 W[rows, cols] (rows/cols: slices with explicit start/stop)."""
        bm, bn = self.block
        q = files.read(weight, rows, cols)
        scale_rows = slice(rows.start // bm, (rows.stop - 1) // bm + 1)
        scale_cols = slice(cols.start // bn, (cols.stop - 1) // bn + 1)
        scale = files.read(weight + "_scale_inv", scale_rows, scale_cols)
        return dequantize_fp8_block(q, scale, self.block, rows.start, cols.start)

    def read_packed(
        self, files: CheckpointFiles, weight: str, leaf: str, rows: slice, cols: slice, shape: tuple[int, int]
    ) -> torch.Tensor:
        """`leaf` ("weight": float8_e4m3fn, "weight_scale_inv": fp32) of W[rows, cols], W of `shape`.

        The slice is a standalone block-quantized matrix only when it cuts on whole blocks: anything else
        raises CheckpointError."""
        bm, bn = self.block
        for what, s, b, n in (("rows", rows, bm, shape[0]), ("columns", cols, bn, shape[1])):
            if s.start % b or (s.stop % b and s.stop != n):
                raise CheckpointError(
                    f"{files.file_of(weight)}: tensor {weight}: {what} [{s.start}, {s.stop}) of {n} do not cut its "
                    f"FP8 {bm}x{bn} scale blocks whole; packed FP8 weights are sliced on whole blocks (use a "
                    "tensor-parallel size that keeps them whole, or --expert-parallel for routed experts; "
                    "load_target(dequantize=True) takes any slice)"
                )
        if leaf == "weight":
            return files.read(weight, rows, cols)
        if leaf != "weight_scale_inv":
            raise CheckpointError(f"tensor {weight}: no FP8 companion {leaf!r}")
        blocks = slice(rows.start // bm, -(-rows.stop // bm)), slice(cols.start // bn, -(-cols.stop // bn))
        return files.read(weight + "_scale_inv", *blocks)
