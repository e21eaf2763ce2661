"""INT4 nibbles to the dot's dtype with integer ops, no int -> float conversion and no fp32 math on the hot path
(the fused MoE's weight tiles, moe.fused._weight_tile).

A nibble n in [0, 15] (the packed value v + 8, quant_formats.PACK) ORed into the mantissa of a power of two
is that power plus n, exactly, as a bit pattern:
    bf16 0x4300 | n = 128 + n        fp16 0x6400 | n = 1024 + n        fp32 0x4B000000 | n = 2^23 + n
and subtracting (power + 8) in the same dtype gives v = n - 8 exactly (small integers are exact in all three).
Then v · scale in the dot's dtype: v has 4 significant bits and a bf16 / fp16 scale 8 / 11, so the product
is exact before its one rounding, round(v · s), bit for bit what the fp32 product rounded to the dot's dtype
gives (the path this replaces: v.to(fp32) · s.to(fp32), then .to(dot)). On sm_90 / sm_120 the bf16 subtract
and multiply are native bf16x2 instructions (two elements each), where the fp32 path needed an I2F, an FMUL
and an F2F per element. A scale of another dtype than the dot's (fp32 scales) keeps the fp32 product.

The Triton interpreter's bf16 arithmetic is not IEEE (mla.checks.kernel_dims), so interpreted kernels use
fp32 dots (the fp32 row above, the same scheme); the bf16 and fp16 rows run on GPUs (`ddtree selftest gpu`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_dequant(nib, scale, DOT: tl.constexpr):
    """nib int32 in [0, 15] -> (nib - 8) · scale in DOT (scale broadcast against nib)."""
    if DOT == tl.bfloat16 and scale.dtype == tl.bfloat16:
        v = (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + nib
        return (v - 136.0) * scale
    elif DOT == tl.float16 and scale.dtype == tl.float16:
        v = (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + nib
        return (v - 1032.0) * scale
    else:
        v = (nib | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + nib
        return ((v - 8388616.0) * scale.to(tl.float32)).to(DOT)
