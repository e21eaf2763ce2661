"""The INT4 unpack two nibbles per 32-bit op (kernels/gemm/int4_dequant.int4_dequant_words): the same values, bit
for bit, as one nibble at a time (int4_dequant, the fused MoE's unpack before) and as the torch reference's (n
- 8) · scale rounded once to the dot's dtype, for every nibble value and words with the sign bit set; and the
same from words in pair order (quant_formats.pair_int4_words, the device path's). Interpreted: the bf16 row's
bit patterns (128 + n) and its arithmetic replayed in torch (the interpreter's bf16 arithmetic is not IEEE);
the fp16 and fp32 rows' values in the kernel itself."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_env import DEVICE, triton_interpret_env  # noqa: F401  (before kernels are imported)

# isort: split
import triton
import triton.language as tl

from ddtree.kernels.gemm.int4_dequant import int4_column_order, int4_dequant, int4_dequant_words, int4_magic_pairs
from ddtree.kernels.quant_formats import pair_int4_words, unpack_int4

R, C = 4, 8  # words [R, C] -> a [8 R, C] tile
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _words(seed: int = 0) -> torch.Tensor:
    """int32 [R, C]: rows 0 and 1 hold every nibble value in every position (nibble j of column c is
    (c + j) % 16, then (c + j + 8) % 16), the other rows random words (about half with the sign bit set)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2**32, (R, C), generator=g, dtype=torch.int64)
    c = torch.arange(C)
    for row, offset in ((0, 0), (1, 8)):
        words[row] = sum(((c + j + offset) % 16) << (4 * j) for j in range(8))
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int64 [8 R, C]: row 8 r + j is nibble j of word [r, c] (quant_formats' unpacking)."""
    return (unpack_int4(words.t().contiguous()).t().to(torch.int64) + 8).contiguous()


@triton.jit
def _pairs_kernel(WORDS, OUT, MAGIC: tl.constexpr, PAIRED: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    bits = int4_column_order(int4_magic_pairs(tl.load(WORDS + offs), MAGIC), PAIRED)  # int4_dequant_words' order
    tl.store(OUT + tl.arange(0, 8 * R)[:, None] * C + tl.arange(0, C)[None, :], bits)


@pytest.mark.parametrize("paired", [False, True], ids=["checkpoint-order", "pair-order"])
@pytest.mark.parametrize("magic", [0x4300, 0x6400])
def test_magic_pairs_are_one_nibble_at_a_time_bits(magic, paired):
    """Two nibbles per op give the bit patterns MAGIC | n of the per-nibble path, in column order, from words
    in checkpoint order or in pair order."""
    words = _words()
    stored = pair_int4_words(words) if paired else words
    out = torch.empty(8 * R, C, dtype=torch.int16, device=DEVICE)
    _pairs_kernel[(1,)](stored.to(DEVICE), out, MAGIC=magic, PAIRED=paired, R=R, C=C)
    assert torch.equal(out.cpu().to(torch.int64), _nibbles(words) | magic)


def test_bf16_pair_arithmetic_is_the_rounded_fp32_product():
    """The bf16 row's arithmetic on those bits, as a GPU runs it (IEEE bf16, replayed by torch): (128 + n) - 136
    is exact and times a bf16 scale rounds once to the fp32 product's bf16 rounding, for all 16 nibbles and
    scales of every exponent range the checkpoints use, subnormal included."""
    g = torch.Generator().manual_seed(1)
    scales = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-6, 3, (4096,), generator=g),
                        torch.tensor([1e-40, -3e-39, 2.0**-126, 65504.0, 3e38 / 8])]).to(torch.bfloat16)  # fmt: skip
    n = torch.arange(16)
    magic = ((n | 0x4300).to(torch.int16)).view(torch.bfloat16)  # 128 + n
    got = (magic[:, None] - torch.tensor(136.0, dtype=torch.bfloat16)) * scales[None, :]
    want = ((n - 8).float()[:, None] * scales.float()[None, :]).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@triton.jit
def _dequant_kernel(WORDS, PAIRED_WORDS, S, OUT, PAIRED_OUT, ONE, DOT: tl.constexpr, R: tl.constexpr,
                    C: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    words = tl.load(WORDS + offs)
    s = tl.load(S + offs)
    rows = tl.arange(0, 8 * R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(OUT + rows, int4_dequant_words(words, s, DOT))
    tl.store(PAIRED_OUT + rows, int4_dequant_words(tl.load(PAIRED_WORDS + offs), s, DOT, True))
    j = tl.arange(0, 8)
    nib = (words[:, None, :] >> (j * 4)[None, :, None]) & 0xF  # [R, 8, C], one nibble at a time
    tl.store(ONE + rows, tl.reshape(int4_dequant(nib, s[:, None, :], DOT), [8 * R, C]))


# (dot, scale dtype): a 16-bit dot with scales of its dtype pairs nibbles; the others run one nibble in fp32
CASES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float16),
         (torch.float16, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("dot,scale_dtype", CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_words_dequantize_as_one_nibble_at_a_time_and_the_reference(dot, scale_dtype):
    """int4_dequant_words equals int4_dequant and (n - 8) · scale rounded once to the dot's dtype, bit for bit,
    from the checkpoint's words and from the same words in pair order."""
    words = _words(seed=2)
    g = torch.Generator().manual_seed(3)
    scale = (torch.randn(R, C, generator=g) * 10.0 ** torch.randint(-4, 2, (R, C), generator=g)).to(scale_dtype)
    out = torch.empty(8 * R, C, dtype=dot, device=DEVICE)
    paired, one = torch.empty_like(out), torch.empty_like(out)
    _dequant_kernel[(1,)](words.to(DEVICE), pair_int4_words(words).to(DEVICE), scale.to(DEVICE), out, paired, one,
                          DOT=_TL[dot], R=R, C=C)  # fmt: skip
    per_row = scale.float().repeat_interleave(8, dim=0)  # word r's scale for rows 8 r .. 8 r + 7
    want = ((_nibbles(words) - 8).float() * per_row).to(dot)
    bits = torch.int16 if dot != torch.float32 else torch.int32
    assert torch.equal(out.cpu().view(bits), one.cpu().view(bits))
    assert torch.equal(paired.cpu().view(bits), out.cpu().view(bits))
    assert torch.equal(out.cpu(), want)
