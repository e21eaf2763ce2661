"""The arithmetic of the two quantized weight formats, shared by the loader (which reads checkpoints),
the packed modules (which hold the weights) and the kernels' torch references.

- INT4 compressed-tensors `pack-quantized`, symmetric, group-wise (Kimi K2 / K2.5 / K2.6): int32 words
  [N, ceil(K/8)]; nibble k of a word (bits 4k..4k+3, little-endian) holds column 8·word + k as v + 8;
  scale [N, ceil(K/group)]; W[i, j] = (nibble - 8) · scale[i, j // group].
  The device path keeps the routed experts' words in pair order instead (`pair_int4_words`): slot s of a
  word (bits 4s..4s+3) holds column PAIR_ORDER[s] of its 8, so that slots i and i + 4 are columns 2i and
  2i + 1, the two halves one shift-and-mask of the word makes (kernels/gemm/int4_dequant.py).
- FP8 e4m3 with block scales (DeepSeek-V3 / R1): W float8_e4m3fn [N, K], scale_inv fp32
  [ceil(N/bn), ceil(K/bk)]; W[i, j] = float(q[i, j]) · scale_inv[i // bn, j // bk].
"""

from __future__ import annotations

import torch

PACK = 8  # nibbles per int32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., m, w] -> int8 [..., m, 8w] in [-8, 7]: column 8·word + k is nibble k minus 8."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    b = packed.contiguous().view(torch.uint8)  # little-endian: byte j holds nibbles 2j (low) and 2j+1 (high)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).view(*packed.shape[:-1], -1)
    return nibbles.to(torch.int8) - 8


PAIR_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # pair order: the column (of a word's 8) that slot s holds
_CHECKPOINT_SLOT = tuple(PAIR_ORDER.index(j) for j in range(PACK))  # pair order: the slot that holds column j


def _move_nibbles(words: torch.Tensor, source_slot: tuple[int, ...]) -> torch.Tensor:
    """int32 words whose slot s is slot source_slot[s] of `words` (any shape; a permutation of nibbles)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for s, src in enumerate(source_slot):
        out |= ((w >> (4 * src)) & 0xF) << (4 * s)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def pair_int4_words(words: torch.Tensor) -> torch.Tensor:
    """Checkpoint order -> pair order (slot s holds column PAIR_ORDER[s]); int32 of the same shape."""
    return _move_nibbles(words, PAIR_ORDER)


def unpair_int4_words(words: torch.Tensor) -> torch.Tensor:
    """Pair order -> checkpoint order (slot j holds column j): pair_int4_words' inverse."""
    return _move_nibbles(words, _CHECKPOINT_SLOT)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """int32 [..., N, ceil(K/8)] + scale [..., N, ceil(K/g)] -> fp32 [..., N, K]."""
    q = unpack_int4(packed)[..., :in_features].float()
    s = scale.float()[..., None].expand(*scale.shape, group_size).flatten(-2)[..., :in_features]  # static shape
    return q.mul_(s)


def quantize_int4_group(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (weight_packed int32 [out, ceil(in/8)], weight_scale bf16 [out, ceil(in/g)], weight_shape).

    Symmetric, scale = amax/7 per group (rounded to bf16 first, then used to quantise), values in [-8, 7].
    """
    out, n = w.shape
    n_groups = -(-n // group_size)
    padded = torch.zeros(out, n_groups * group_size)
    padded[:, :n] = w.float()
    g = padded.view(out, n_groups, group_size)
    scale = (g.abs().amax(dim=2) / 7.0).clamp(min=1e-8).to(torch.bfloat16)  # [out, n_groups]
    q = (g / scale.float()[:, :, None]).round().clamp(-8, 7).view(out, -1)[:, :n]
    words = -(-n // PACK)
    u = torch.zeros(out, words * PACK, dtype=torch.int64)
    u[:, :n] = q.to(torch.int64) + 8
    shifts = torch.arange(PACK, dtype=torch.int64) * 4
    packed = (u.view(out, words, PACK) << shifts).sum(dim=-1)  # [out, words], < 2^32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.contiguous(), scale.contiguous(), torch.tensor([out, n], dtype=torch.int32)


def dequantize_fp8_block(
    q: torch.Tensor,  # float8_e4m3fn [..., m, n]: the window of W starting at (row0, col0)
    scale_inv: torch.Tensor,  # [..., .., ..] the scale blocks covering that window, first block = row0//bm, col0//bn
    block: tuple[int, int],
    row0: int = 0,
    col0: int = 0,
) -> torch.Tensor:  # fp32 [..., m, n]
    bm, bn = block
    m, n = q.shape[-2:]
    qf = fp8_to_float(q)
    if row0 % bm == 0 and col0 % bn == 0 and m % bm == 0 and n % bn == 0:  # whole blocks: broadcast the scales
        s = scale_inv.float()[..., : m // bm, : n // bn]
        return (
            qf.unflatten(-1, (n // bn, bn))
            .unflatten(-3, (m // bm, bm))
            .mul_(s[..., :, None, :, None])
            .flatten(-4, -3)
            .flatten(-2)
        )
    ri = torch.arange(row0, row0 + m, device=q.device) // bm - row0 // bm  # [m] scale row of each weight row
    ci = torch.arange(col0, col0 + n, device=q.device) // bn - col0 // bn  # [n]
    scale = scale_inv.float()[..., ri, :][..., ci]  # [..., m, n]
    return qf.mul_(scale)


_E4M3_TABLE: dict[torch.device, torch.Tensor] = {}


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32, the same values as q.float(); on the CPU through a 256-entry table (about twice
    as fast as the cast there)."""
    if q.device.type != "cpu":
        return q.float()
    table = _E4M3_TABLE.get(q.device)
    if table is None:
        table = _E4M3_TABLE[q.device] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(q.dtype).float()
    return torch.take(table, q.contiguous().view(torch.uint8).long())


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] -> (float8_e4m3fn [M, N], float32 scale_inv [ceil(M/bm), ceil(N/bn)]): amax/448 per block."""
    bm, bn = block
    M, N = w.shape
    Mb, Nb = -(-M // bm), -(-N // bn)
    padded = torch.zeros(Mb * bm, Nb * bn, dtype=torch.float32)
    padded[:M, :N] = w.float()
    blocks = padded.view(Mb, bm, Nb, bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [Mb, Nb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(Mb * bm, Nb * bn)[:M, :N]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
