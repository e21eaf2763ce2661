"""INT4 compressed-tensors `pack-quantized` weights, symmetric, group-wise (Kimi K2-Thinking / K2.5 / K2.6).

quantization_config: `{quant_method: compressed-tensors, format: pack-quantized, config_groups: {group_0:
{targets: [Linear], weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}},
ignore: [lm_head, re:.*self_attn.*, re:.*shared_experts.*, re:.*mlp\\.(gate|up|gate_up|down)_proj.*, ...]}`.
Each quantised Linear `X` [out, in] stores
- `X.weight_packed` int32 [out, ceil(in/8)]: nibble k of a word (bits 4k..4k+3) holds column 8·word + k as
  an unsigned value v + 8, so the signed value is nibble - 8 in [-8, 7] (compressed-tensors
  `pack_to_int32` / `unpack_from_int32`: little-endian bytes, low nibble first);
- `X.weight_scale` [out, ceil(in/group)] (bf16 in the Kimi checkpoints; read whatever float the header says);
- `X.weight_shape` int [2] = [out, in].
W[i, j] = (nibble - 8) · scale[i, j // group]; no zero point. `read` dequantizes a slice (fp32; a column
slice reads the packed words and scales of the groups that cover it and trims; a row slice reads just
those rows); `read_packed` returns the stored words / scales of it, for the packed modules, and needs a
column slice on whole groups (or ending at the edge).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ddtree.kernels.quant_formats import PACK, quantize_int4_group, unpack_int4
from ddtree.kernels.weight_formats import INT4_PACK, WeightFormat
from ddtree.models.checkpoint.files import CheckpointError, CheckpointFiles
from ddtree.models.quantization.names import any_matches, is_targeted

__all__ = ["PACK", "Int4Group", "Int4PackScheme", "quantize_int4_group", "unpack_int4"]


@dataclass(frozen=True)
class Int4Group:
    targets: tuple[str, ...]
    group_size: int


@dataclass(frozen=True)
class Int4PackScheme:
    groups: tuple[Int4Group, ...]
    ignore: tuple[str, ...] = ()
    name: str = INT4_PACK.quant_method
    weight_format: ClassVar[WeightFormat] = INT4_PACK

    @classmethod
    def from_config(cls, qc: Mapping[str, Any], source: str) -> Int4PackScheme:
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{source}: quantization_config {what} is not supported (INT4 pack-quantized only)")

        fmt = qc.get("format")
        groups = []
        for key, g in (qc.get("config_groups") or {}).items():
            w = g.get("weights") or {}
            gfmt = g.get("format") or fmt
            if gfmt != "pack-quantized":
                raise bad(f"format {gfmt!r} ({key})")
            spec = (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"))
            if spec != (4, "int", True, "group"):
                raise bad(f"{key}.weights num_bits/type/symmetric/strategy {spec}")
            size = w.get("group_size")
            if not isinstance(size, int) or size <= 0 or size % PACK:
                raise bad(f"{key}.weights.group_size {size!r} (must be a multiple of {PACK})")
            groups.append(Int4Group(tuple(g.get("targets") or ()), size))
        if not groups:
            raise bad("without config_groups")
        return cls(groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()))

    def group_of(self, names: tuple[str, ...]) -> Int4Group | None:
        if any_matches(names, self.ignore):
            return None
        return next((g for g in self.groups if is_targeted(names, g.targets)), None)

    def quantizes(self, names: tuple[str, ...]) -> bool:
        return self.group_of(names) is not None

    def params(self, names: tuple[str, ...]) -> tuple[int, tuple[int, int]]:
        """(group size, scale block) of a weight it quantizes."""
        return self.group_of(names).group_size, (128, 128)

    def stored_names(self, weight: str) -> tuple[str, ...]:
        return weight + "_packed", weight + "_scale", weight + "_shape"

    def logical_shape(self, files: CheckpointFiles, weight: str) -> tuple[int, ...]:
        packed, scale, shape_name = self.stored_names(weight)
        if files.dtype(packed) != "I32":
            raise CheckpointError(f"{files.file_of(packed)}: tensor {packed} is {files.dtype(packed)}, expected I32")
        out, words = files.shape(packed)
        shape = tuple(int(v) for v in files.read(shape_name).tolist())
        if len(shape) != 2 or shape[0] != out or -(-shape[1] // PACK) != words:
            raise CheckpointError(
                f"{files.file_of(packed)}: tensor {packed} has shape {[out, words]}, which does not pack "
                f"{shape_name} = {list(shape)}"
            )
        return shape

    def read(
        self, files: CheckpointFiles, weight: str, rows: slice, cols: slice, group_size: int, in_features: int
    ) -> torch.Tensor:
        """Dequantised fp32 W[rows, cols] (slices with explicit start/stop)."""
        packed, scale = weight + "_packed", weight + "_scale"
        self._check_scale(files, weight, group_size, in_features)
        g0, g1 = cols.start // group_size, -(-cols.stop // group_size)  # covering groups
        w0, w1 = g0 * group_size // PACK, min(g1 * group_size // PACK, files.shape(packed)[1])
        q = unpack_int4(files.read(packed, rows, slice(w0, w1)))  # int8 [m, 8·(w1-w0)]
        s = files.read(scale, rows, slice(g0, g1)).float().repeat_interleave(group_size, dim=1)
        lo = cols.start - g0 * group_size
        hi = cols.stop - g0 * group_size
        return q[:, lo:hi].float().mul_(s[:, lo:hi])

    def read_packed(
        self,
        files: CheckpointFiles,
        weight: str,
        leaf: str,
        rows: slice,
        cols: slice,
        group_size: int,
        shape: tuple[int, int],
    ) -> torch.Tensor:
        """`leaf` ("weight_packed" int32, "weight_scale", "weight_shape") of W[rows, cols], W of `shape`.

        Columns must be cut on whole groups (then also on whole int32 words): anything else raises
        CheckpointError. `weight_shape` is the slice's own [rows, cols]."""
        K = shape[1]
        if cols.start % group_size or (cols.stop % group_size and cols.stop != K):
            raise CheckpointError(
                f"{files.file_of(weight + '_packed')}: tensor {weight}: columns [{cols.start}, {cols.stop}) of {K} "
                f"do not cut its INT4 groups of {group_size} whole; packed INT4 weights are sliced on whole groups "
                "(use a tensor-parallel size that keeps them whole, or --expert-parallel for routed experts; "
                "load_target(dequantize=True) takes any slice)"
            )
        if leaf == "weight_packed":
            return files.read(weight + "_packed", rows, slice(cols.start // PACK, -(-cols.stop // PACK)))
        if leaf == "weight_scale":
            self._check_scale(files, weight, group_size, K)
            groups = slice(cols.start // group_size, -(-cols.stop // group_size))
            return files.read(weight + "_scale", rows, groups)
        if leaf == "weight_shape":
            return torch.tensor([rows.stop - rows.start, cols.stop - cols.start], dtype=torch.int32)
        raise CheckpointError(f"tensor {weight}: no INT4 companion {leaf!r}")

    @staticmethod
    def _check_scale(files: CheckpointFiles, weight: str, group_size: int, in_features: int) -> None:
        packed, scale = weight + "_packed", weight + "_scale"
        n_groups = -(-in_features // group_size)
        if tuple(files.shape(scale)) != (files.shape(packed)[0], n_groups):
            raise CheckpointError(
                f"{files.file_of(scale)}: tensor {scale} has shape {list(files.shape(scale))}, expected "
                f"{[files.shape(packed)[0], n_groups]} (group size {group_size})"
            )
