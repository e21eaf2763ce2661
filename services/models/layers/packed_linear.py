"""Linear layers that hold their weight in the checkpoint's quantized format (docs/design.md §6).

Buffers are named as in the checkpoint, so `state_dict()` keys are the stored names:
- `Int4Linear`: `weight_packed` int32 [N, ceil(K/8)], `weight_scale` [N, ceil(K/g)] (the stored float
  dtype, bf16 in Kimi), `weight_shape` int32 [2] = [N, K] (compressed-tensors pack-quantized, symmetric);
- `Fp8Linear`: `weight` float8_e4m3fn [N, K], `weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)].
N = out_features, K = in_features (the rank's shard of them under tensor parallelism); an optional float
`bias` [N]. The format arithmetic is kernels/quant_formats.py.

Forward: on CUDA the Triton GEMM when it is installed (`ddtree.kernels.gemm.int4.int4_gemm`, W4A16;
`fp8_gemm.fp8_block_gemm`, W8A8 with per-token-group activation quantization, column blocks a power of
two >= 32); everywhere else the weight is dequantized per call (fp32, then the input's dtype;
`CHUNK_ELEMENTS` weights at a time) and multiplied with F.linear, so the result equals an nn.Linear
holding the dequantized weight in that dtype. Nothing full-precision is kept.

`PACKED_LEAVES` names the tensors whose dtype the loader keeps (everything else follows the model dtype).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels.quant_formats import PACK, dequantize_fp8_block, dequantize_int4

CHUNK_ELEMENTS = 1 << 24  # dequantize at most this many weight elements at once (64 MiB in fp32)


@functools.cache
def cuda_kernel(name: str):
    """The Triton entry point `name` ("int4_gemm", "fp8_block_gemm": a format's `gemm` in
    kernels/weight_formats.py; "fused_moe"), or None when triton is not installed."""
    if name not in ("int4_gemm", "fp8_block_gemm", "fused_moe"):
        raise ValueError(f"unknown kernel {name!r}")
    try:
        # triton is an optional extra (the runtime install has none): without it the weight is dequantized
        from ddtree.kernels.gemm import fp8 as fp8_gemm
        from ddtree.kernels.gemm import int4 as int4_gemm
        from ddtree.kernels.moe import fused as fused_moe
    except ImportError:
        return None
    entry_points = {
        "int4_gemm": int4_gemm.int4_gemm,
        "fp8_block_gemm": fp8_gemm.fp8_block_gemm,
        "fused_moe": fused_moe.fused_moe,
    }
    return entry_points[name]


class KeepsPackedDtypes(nn.Module):
    """A module whose `PACKED_LEAVES` buffers keep their dtype through `.to(dtype)` / `.half()` / ...:
    those move device only (a cast would destroy the format, e.g. fp8 values or fp32 block scales)."""

    PACKED_LEAVES: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {leaf: self._buffers[leaf] for leaf in self.PACKED_LEAVES if self._buffers.get(leaf) is not None}
        self._buffers.update(dict.fromkeys(saved))
        try:
            super()._apply(fn, recurse)
        finally:
            for leaf, t in saved.items():
                device = fn(torch.empty(0, dtype=t.dtype, device=t.device)).device  # the move without the cast
                self._buffers[leaf] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self


class _PackedLinear(KeepsPackedDtypes):
    device_path = False  # the Triton GEMM off CUDA too (interpreted): device_linear.route_linears sets it

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:  # fp32 [stop - start, K]
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight [N, K] (fp32 unless `dtype`): for callers that need it dense (MLA's kv_b_proj)."""
        w = self.dequantize_rows(0, self.out_features)
        return w if dtype is None else w.to(dtype)

    def kernel_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] -> [M, N] by the Triton GEMM (CUDA, or the interpreter); None when it is not installed."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N], dtype of x
        if x.is_cuda or self.device_path:
            y = self.kernel_gemm(x.reshape(-1, x.shape[-1]))  # the GEMMs take [M, K]
            if y is not None:
                y = y.view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        N, K = self.out_features, self.in_features
        step = max(1, CHUNK_ELEMENTS // max(K, 1))
        if step >= N:
            return F.linear(x, self.dequantize_rows(0, N).to(x.dtype), self.bias)
        out = x.new_empty(*x.shape[:-1], N)
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            bias = None if self.bias is None else self.bias[n0:n1]
            out[..., n0:n1] = F.linear(x, self.dequantize_rows(n0, n1).to(x.dtype), bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(_PackedLinear):
    """y = x · Wᵀ (+ b) with W = (nibble - 8) · scale[:, k // group_size]."""

    PACKED_LEAVES = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(in_features, out_features, bias)
        if group_size <= 0 or group_size % PACK:
            raise ValueError(f"Int4Linear: group_size must be a positive multiple of {PACK}, got {group_size}")
        self.group_size = group_size
        N, K = out_features, in_features
        self.register_buffer("weight_packed", torch.empty(N, -(-K // PACK), dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(N, -(-K // group_size), dtype=scale_dtype))
        self.register_buffer("weight_shape", torch.tensor([N, K], dtype=torch.int32))

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        return dequantize_int4(
            self.weight_packed[start:stop], self.weight_scale[start:stop], self.group_size, self.in_features
        )

    def kernel_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        gemm = cuda_kernel("int4_gemm")
        if gemm is None:
            return None
        return gemm(x, self.weight_packed, self.weight_scale, self.group_size, self.in_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4 group_size={self.group_size}"


class Fp8Linear(_PackedLinear):
    """y = x · Wᵀ (+ b) with W[i, j] = float(q[i, j]) · scale_inv[i // bn, j // bk]."""

    PACKED_LEAVES = ("weight", "weight_scale_inv")

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = (128, 128), bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.block = (int(block[0]), int(block[1]))
        bn, bk = self.block
        N, K = out_features, in_features
        self.register_buffer("weight", torch.empty(N, K, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(-(-N // bn), -(-K // bk), dtype=torch.float32))

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        bn = self.block[0]
        scale = self.weight_scale_inv[start // bn : (stop - 1) // bn + 1] if stop > start else self.weight_scale_inv[:0]
        return dequantize_fp8_block(self.weight[start:stop], scale, self.block, row0=start)

    def kernel_gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        bk = self.block[1]
        gemm = cuda_kernel("fp8_block_gemm") if bk >= 32 and bk & (bk - 1) == 0 else None  # the kernel's BLOCK_K
        if gemm is None:
            return None
        return gemm(x, self.weight, self.weight_scale_inv, block_size=self.block)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 block={list(self.block)}"


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] weight of an nn.Linear (as stored) or of a packed linear (dequantized now, in `dtype`)."""
    if isinstance(linear, _PackedLinear):
        return linear.dequantized(dtype)
    return linear.weight
