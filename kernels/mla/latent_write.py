"""Fused latent KV write: kv[slots] = [RMSNorm(c_kv) ; RoPE(k_pe)] in one launch.

In mla.py the write is project_latent (split, the kv_a RMSNorm: ~6 elementwise kernels; interleaved YaRN
RoPE on k_pe: ~12; cat; cast) followed by an index_put at meta.write_slots: about 20 small launches per
layer, whose launch costs together rival the attention itself at decode / verify sizes. This
kernel does it in one pass over the [T, r + dr] projection, one program per token, with the same
rounding as the torch code (HF RMSNorm: normalise in fp32, round to the model dtype, multiply by the
weight and round again; RoPE in fp32, rounded once). bf16 rounding is done explicitly (round to nearest
even on the fp32 bits), which also keeps the interpreter exact (its own bf16 casts truncate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import DTYPES, check_device, is_interpreted


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _latent_write_kernel(
    LATENT, KV, SLOTS, POS, WEIGHT, INV_FREQ,
    stride_lat, stride_kv, eps, attention_factor,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, HALF_DR: tl.constexpr, IS_BF16: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_R)
    ok = offs < R
    x = tl.load(LATENT + t * stride_lat + offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_R]
    n = x * tl.rsqrt(tl.sum(x * x, 0) / R + eps)
    w = tl.load(WEIGHT + offs, mask=ok, other=0.0).to(tl.float32)
    if IS_BF16:
        c = _round_bf16(w * _round_bf16(n))
    else:
        c = w * n.to(KV.dtype.element_ty).to(tl.float32)
    tl.store(KV + slot * stride_kv + offs, c.to(KV.dtype.element_ty), mask=ok)

    i = tl.arange(0, HALF_DR)
    ang = tl.load(POS + t).to(tl.float32) * tl.load(INV_FREQ + i)  # [dr/2]
    cos = tl.cos(ang) * attention_factor
    sin = tl.sin(ang) * attention_factor
    even = tl.load(LATENT + t * stride_lat + R + 2 * i).to(tl.float32)
    odd = tl.load(LATENT + t * stride_lat + R + 2 * i + 1).to(tl.float32)
    e_out = even * cos - odd * sin
    o_out = odd * cos + even * sin
    if IS_BF16:
        e_out = _round_bf16(e_out)
        o_out = _round_bf16(o_out)
    tl.store(KV + slot * stride_kv + R + 2 * i, e_out.to(KV.dtype.element_ty))
    tl.store(KV + slot * stride_kv + R + 2 * i + 1, o_out.to(KV.dtype.element_ty))


def write_latent(
    kv: torch.Tensor,  # [S, r + dr] one layer's cache, written in place
    latent: torch.Tensor,  # [T, r + dr] kv_a_proj_with_mqa output (c_kv not normalised, k_pe not rotated)
    slots: torch.Tensor,  # int64 / int32 [T] on kv's device, distinct, in [0, S)
    positions: torch.Tensor,  # int64 [T]
    norm_weight: torch.Tensor,  # [r] kv_a_layernorm.weight
    eps: float,
    inv_freq: torch.Tensor,  # fp32 [dr / 2] on kv's device
    attention_factor: float = 1.0,
    check_slots: bool = True,  # bounds-check slots on the device (a host sync); off once the caller checked
) -> None:
    """kv[slots] = [RMSNorm(c_kv) ; RoPE(k_pe)], equal to services/models/deepseek_v3/mla.py's project_latent + scatter."""
    T = latent.shape[0] if latent.dim() == 2 else -1
    r = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if latent.dim() != 2 or kv.dim() != 2 or latent.shape[1] != kv.shape[1] or r < 1 or r >= kv.shape[1]:
        raise ValueError(f"latent {tuple(latent.shape)} / kv {tuple(kv.shape)} must be [T, W] / [S, W] with "
                         f"W = r + dr, r = {tuple(norm_weight.shape)}")  # fmt: skip
    dr = kv.shape[1] - r
    if dr % 2 or dr & (dr - 1) or inv_freq.shape != (dr // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"dr = {dr} must be an even power of two and inv_freq fp32 [{dr // 2}], got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")  # fmt: skip
    if (slots.shape != (T,) or positions.shape != (T,) or slots.dtype not in (torch.int64, torch.int32)
            or positions.dtype != torch.int64):  # fmt: skip
        raise ValueError(f"slots / positions must be int64 [{T}] (slots may be int32), got {slots.dtype} "
                         f"{tuple(slots.shape)} / {positions.dtype} {tuple(positions.shape)}")  # fmt: skip
    if latent.dtype not in DTYPES or kv.dtype not in DTYPES or norm_weight.dtype not in DTYPES:
        raise ValueError(f"dtypes {latent.dtype} / {kv.dtype} / {norm_weight.dtype} must be in {DTYPES}")
    if latent.dtype != kv.dtype or norm_weight.dtype != kv.dtype:
        raise ValueError(f"latent / kv / norm_weight dtypes differ: {latent.dtype} / {kv.dtype} / {norm_weight.dtype}")
    for name, t in (("latent", latent), ("kv", kv), ("slots", slots), ("positions", positions),
                    ("norm_weight", norm_weight), ("inv_freq", inv_freq)):  # fmt: skip
        if t.device != kv.device:
            raise ValueError(f"{name} is on {t.device}, kv on {kv.device}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    check_device(kv.device, is_interpreted(_latent_write_kernel))
    if T == 0:
        return
    if check_slots and not bool(((slots >= 0) & (slots < kv.shape[0])).all()):
        raise ValueError(f"slots out of range for a cache of {kv.shape[0]} slots")
    _latent_write_kernel[(T,)](
        latent, kv, slots, positions, norm_weight, inv_freq,
        latent.stride(0), kv.stride(0), eps, attention_factor,
        R=r, DR=dr, BLOCK_R=triton.next_power_of_2(r), HALF_DR=dr // 2, IS_BF16=kv.dtype == torch.bfloat16,
    )  # fmt: skip
