"""Input checks of the MLA kernel wrappers: host-side only (shapes, strides, dtypes, devices and the cache
length against the plan's largest slot), so they cost no device sync; the checks every kernel shares are in
kernels/checks.py."""

from __future__ import annotations

import dataclasses

import torch

from ddtree.kernels.checks import DTYPES, check_device
from ddtree.kernels.mla.plan import MLAPlan

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class KernelDims:
    num_heads: int
    r: int
    dr: int
    block_r: int
    block_dr: int
    block_m: int
    dot_precision: str
    bf16_via_fp32: bool


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())  # tl.dot needs every dim >= 16


def kernel_dims(q_lat: torch.Tensor, q_pe: torch.Tensor, plan: MLAPlan, interpreted: bool) -> KernelDims:
    check_device(q_lat.device, interpreted)
    r, dr = q_lat.shape[2], q_pe.shape[2]
    # NOTE: triton 3.9's interpreter mishandles bf16 arithmetic: tl.dot multiplies the raw uint16 bits, and
    # fp32 -> bf16 casts truncate (and carry wrongly when rounding). Interpreted bf16 kernels therefore
    # compute on fp32 copies (bf16 products are exact in fp32), keep P in fp32 and store fp32 output, which
    # the wrapper rounds with torch. Compiled kernels run bf16 dots and round P to bf16 for P·V.
    bf16_via_fp32 = interpreted and q_lat.dtype == torch.bfloat16
    # fp32 inputs: exact fp32 dot products (no TF32), so fp32 results match the fp32 reference
    precision = "ieee" if q_lat.dtype == torch.float32 or bf16_via_fp32 else "tf32"
    return KernelDims(plan.num_heads, r, dr, _pow2(r), _pow2(dr), plan.block_m, precision, bf16_via_fp32)


def check_inputs(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, plan: MLAPlan) -> None:
    """Raise ValueError unless q_lat [T, H, r], q_pe [T, H, dr], kv [S, r + dr] fit the plan."""
    T, H = plan.num_tokens, plan.num_heads
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("kv", kv)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported; use one of {DTYPES}")
        if t.device != plan.device:
            raise ValueError(f"{name} is on {t.device}, the plan on {plan.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    if q_lat.dim() != 3 or q_lat.shape[:2] != (T, H) or q_lat.shape[2] < 1:
        raise ValueError(f"q_lat must be [T={T}, H={H}, r], got {tuple(q_lat.shape)}")
    if q_pe.dim() != 3 or q_pe.shape[:2] != (T, H) or q_pe.shape[2] < 1:
        raise ValueError(f"q_pe must be [T={T}, H={H}, dr], got {tuple(q_pe.shape)}")
    r, dr = q_lat.shape[2], q_pe.shape[2]
    if kv.dim() != 2 or kv.shape[1] != r + dr:
        raise ValueError(f"kv must be [S, r + dr = {r + dr}], got {tuple(kv.shape)}")
    if q_pe.dtype != q_lat.dtype or kv.dtype != q_lat.dtype:
        raise ValueError(f"q_lat / q_pe / kv dtypes differ: {q_lat.dtype} / {q_pe.dtype} / {kv.dtype}")
    if kv.shape[0] < plan.min_cache_slots:
        raise ValueError(f"the plan addresses slot {plan.min_cache_slots - 1}, the cache has {kv.shape[0]} slots")
