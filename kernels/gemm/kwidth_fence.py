"""An identity on a 16-bit dot operand that ends Triton's search for the width the operand was loaded with.

Triton (AccelerateMatmul's computeOrigBitWidth, 3.x) gives an mma.sync (sm_80 .. sm_120, and sm_90 below 64
rows) operand layout its kWidth from the narrowest load behind the two operands, halved once if a join lies
on the way (written for the upcast of packed 4-bit values). A bf16 operand built with joins
(int4_dequant.int4_dequant_words) so gets kWidth 4: both operands are then read from shared memory with 64-bit
loads and moved between registers before every mma instruction (the SASS of the fused MoE's 16-row tiles:
a fifth of the K loop's instructions); with kWidth 2 they are read by ldmatrix straight into place.

The search walks pure elementwise ops, views, loads, broadcasts and layout conversions only. An inline-asm
identity marked impure stops it: a 32-bit register move per two values, which ptxas folds away (no SASS).
The Triton interpreter cannot run inline asm; the 16-bit dots it would sit in never run interpreted (the
fused MoE's interpreted dots are fp32, moe/fused.py), so callers use it on those paths only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kwidth_fence(x):
    """x (a bf16 / fp16 tensor, an even number of values per thread) unchanged."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
