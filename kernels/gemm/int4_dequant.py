"""INT4 nibbles to the dot's dtype with integer ops, no int -> float conversion and no fp32 math on the hot path
(the fused MoE's weight tiles, moe.fused._weight_tile), two nibbles per 32-bit instruction where the dot is
16-bit.

Format (quant_formats.PACK): nibble j of an int32 word (bits 4j..4j+3) is column 8·word + j, holding v + 8.

A nibble n in [0, 15] ORed into the mantissa of a power of two is that power plus n, exactly, as a bit pattern:
    bf16 0x4300 | n = 128 + n        fp16 0x6400 | n = 1024 + n        fp32 0x4B000000 | n = 2^23 + n
and subtracting (power + 8) in the same dtype gives v = n - 8 exactly (small integers are exact in all three).
Then v · scale in the dot's dtype: v has 4 significant bits and a bf16 / fp16 scale 8 / 11, so the product
is exact before its one rounding, round(v · s), bit for bit what the fp32 product rounded to the dot's dtype
gives (v.to(fp32) · s.to(fp32), then .to(dot)). A scale of another dtype than the dot's (fp32 scales) keeps
the fp32 product, rounded once to the dot's dtype.

Two nibbles per instruction (int4_dequant_words; the Marlin / Machete construction): in
    ((w >> 4i) & 0x000F000F) | 0x43004300            i = 0, 1, 2, 3
the two 16-bit halves are the bf16 values 128 + n_i and 128 + n_(i+4), so one shift and one and-or make two
values, and the subtract and the scale multiply run on both halves as one bf16x2 instruction (HADD2, HMUL2:
ptxas pairs the halves of a register). The halves are split by truncation (a register's halves: no
instruction) and put in column order by joins, a permute and a reshape, all within a thread (a join's new
axis is per thread). A word's 8 columns cost 3 shifts, 4 and-ors, 4 subtracts and 4 multiplies, and the
byte permutes that put adjacent columns in one register where the dot reads them so; one nibble at a time
(int4_dequant) was a shift and an and-or per column.

Pair order (quant_formats.pair_int4_words, the device path's routed experts): slot s of a word holds column
PAIR_ORDER[s], so the halves of ((w >> 4i) & 0x000F000F) are columns 2i and 2i + 1, adjacent as the dot's
operand wants them: the byte permutes go (scripts/bench/moe_tile_table.py counts them in the SASS;
docs/performance.md section 12 has the counts).

fp32 dots (the interpreter's, and exact fp32 runs) have nothing to pair: one nibble per 32-bit value, the same
layout. The Triton interpreter's bf16 arithmetic is not IEEE (mla/checks.py kernel_dims): interpreted tests check
the bf16 row's bit patterns (int4_magic_pairs) and the fp16 / fp32 rows' values; the bf16 arithmetic, the
same scheme as fp16's, runs on GPUs (`ddtree selftest gpu`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_dequant(nib, scale, DOT: tl.constexpr):
    """nib int32 in [0, 15] -> (nib - 8) · scale in DOT (scale broadcast against nib), one nibble a value:
    the values int4_dequant_words gives, for layouts that hold one nibble a lane."""
    if DOT == tl.bfloat16 and scale.dtype == tl.bfloat16:
        v = (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + nib
        return (v - 136.0) * scale
    elif DOT == tl.float16 and scale.dtype == tl.float16:
        v = (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + nib
        return (v - 1032.0) * scale
    else:
        v = (nib | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + nib
        return ((v - 8388616.0) * scale.to(tl.float32)).to(DOT)


@triton.jit
def _halves(q):
    """int32 [...] -> int16 [..., 2]: (bits 0..15, bits 16..31), per thread (a join)."""
    return tl.join(q.to(tl.int16), (q >> 16).to(tl.int16))


@triton.jit
def int4_magic_pairs(words, MAGIC: tl.constexpr):
    """int32 words [R, C] -> int16 [R, C, 2, 2, 2]: at [r, c, i0, i1, h] the bits MAGIC | n, n the nibble
    j = i0 + 2 i1 + 4 h of word [r, c] (MAGIC 0x4300: bf16 128 + n; 0x6400: fp16 1024 + n)."""
    m: tl.constexpr = MAGIC * 0x10001  # MAGIC in both halves
    q0 = (words & 0x000F000F) | m  # halves: nibbles 0, 4
    q1 = ((words >> 4) & 0x000F000F) | m  # 1, 5 (an arithmetic shift: the mask drops the sign bits)
    q2 = ((words >> 8) & 0x000F000F) | m  # 2, 6
    q3 = ((words >> 12) & 0x000F000F) | m  # 3, 7
    return _halves(tl.join(tl.join(q0, q1), tl.join(q2, q3)))  # q_(i0 + 2 i1) at [.., i0, i1]


@triton.jit
def _nibble_fp32(words, J: tl.constexpr):
    """Nibble J of each word as the fp32 bit pattern of 2^23 + n (int32)."""
    return ((words >> (4 * J)) & 0xF) | 0x4B000000


@triton.jit
def _magic_nibbles_fp32(words):
    """int32 words [R, C] -> int32 [R, C, 2, 2, 2]: 0x4B000000 | nibble (i0 + 2 i1 + 4 h), int4_magic_pairs'
    layout with one nibble a 32-bit value."""
    lo = tl.join(tl.join(_nibble_fp32(words, 0), _nibble_fp32(words, 1)),
                 tl.join(_nibble_fp32(words, 2), _nibble_fp32(words, 3)))  # fmt: skip
    hi = tl.join(tl.join(_nibble_fp32(words, 4), _nibble_fp32(words, 5)),
                 tl.join(_nibble_fp32(words, 6), _nibble_fp32(words, 7)))  # fmt: skip
    return tl.join(lo, hi)


@triton.jit
def int4_dequant_words(words, scale, DOT: tl.constexpr, PAIRED: tl.constexpr = False):
    """int32 words [R, C] and a scale per word [R, C] -> [8 R, C] in DOT: row 8 r + j is (nibble j of word
    [r, c] - 8) · scale[r, c], bit for bit int4_dequant's value; PAIRED: the words in pair order, row 8 r + j
    from the slot holding column j. 16-bit DOT with scales of its dtype: two nibbles per 32-bit op;
    otherwise one, in fp32."""
    s = scale[:, :, None, None, None]
    if DOT == tl.bfloat16 and scale.dtype == tl.bfloat16:
        w = (int4_magic_pairs(words, 0x4300).to(tl.bfloat16, bitcast=True) - 136.0) * s  # exact, then one rounding
    elif DOT == tl.float16 and scale.dtype == tl.float16:
        w = (int4_magic_pairs(words, 0x6400).to(tl.float16, bitcast=True) - 1032.0) * s
    else:
        v = _magic_nibbles_fp32(words).to(tl.float32, bitcast=True)
        w = ((v - 8388616.0) * s.to(tl.float32)).to(DOT)
    return int4_column_order(w, PAIRED)


@triton.jit
def int4_column_order(w, PAIRED: tl.constexpr):
    """[R, C, 2, 2, 2] in int4_magic_pairs' layout (slot i0 + 2 i1 + 4 h of word [r, c]) -> [8 R, C], row
    8 r + j the word's column j: slot j in checkpoint order; in pair order the slot holding column j."""
    R: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1]
    if PAIRED:  # slot i0 + 2 i1 + 4 h holds column 2 i0 + 4 i1 + h: [R, i1, i0, h, C], each register's halves
        w = tl.permute(w, (0, 3, 2, 4, 1))  # adjacent rows, so no byte permute pairs them for the dot
    else:
        w = tl.permute(w, (0, 4, 3, 2, 1))  # [R, h, i1, i0, C]: row 8 r + 4 h + 2 i1 + i0 = 8 r + j
    return tl.reshape(w, [8 * R, C])
