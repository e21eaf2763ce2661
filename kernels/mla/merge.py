"""LSE merge of the split partials: one program per (row of a merged tile, block of MERGE_V values).

For one row with partials (o_s normalised, lse_s) over s = the tile's items (new tokens + prefix splits):

    m = max_s lse_s;   w_s = exp(lse_s - m);   o = Σ_s w_s · o_s / Σ_s w_s

in one pass over CHUNK items at a time, rescaling by exp(m_old - m_new) as the running max grows. Splitting the work
by row and value block keeps many programs in flight however many partials a tile has: the decode of a
32k prefix (one tile, ~128 splits) is merged by 16 rows × 4 blocks, not by one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.mla.checks import KernelDims
from ddtree.kernels.mla.plan import SEQ_FIELDS, MLAPlan

MERGE_V = 128  # values per program
CHUNK = 32  # partials loaded at once (a 32k decode has ~128: 4 rounds)


@triton.jit
def _mla_merge_kernel(
    SEQS, TILES, MERGE_TILES, PART_O, PART_LSE, OUT, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    MERGE_V: tl.constexpr, CHUNK: tl.constexpr, SEQ_W: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tile = tl.load(MERGE_TILES + pid // BLOCK_M)
    r_local = pid % BLOCK_M
    seq = tl.load(TILES + tile * 4)
    row = tl.load(TILES + tile * 4 + 1) + r_local
    part_start = tl.load(TILES + tile * 4 + 2).to(tl.int64)
    q_start = tl.load(SEQS + seq * SEQ_W)
    q_len = tl.load(SEQS + seq * SEQ_W + 1)
    # rows past the end, or a tile of no parts (a static plan's padding of the list): nothing
    n = tl.where(row < q_len * NUM_HEADS, tl.load(TILES + tile * 4 + 3), 0)

    offs_c = tl.arange(0, CHUNK)
    offs_v = tl.program_id(1) * MERGE_V + tl.arange(0, MERGE_V)
    v_ok = offs_v < R
    m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)  # fp32 scalars, carried by the loop
    w_sum = tl.sum(tl.zeros([CHUNK], tl.float32), 0)
    acc = tl.zeros([MERGE_V], tl.float32)
    for c0 in range(0, n, CHUNK):  # one pass, rescaling as the running max grows
        c = c0 + offs_c
        ok = c < n
        lse = tl.load(PART_LSE + (part_start + c) * BLOCK_M + r_local, mask=ok, other=float("-inf"))  # [CHUNK]
        o = tl.load(
            PART_O + ((part_start + c) * BLOCK_M + r_local)[:, None] * BLOCK_R + offs_v[None, :],
            mask=ok[:, None] & v_ok[None, :],
            other=0.0,
        )  # [CHUNK, MERGE_V]
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: every partial saw >= 1 key
        alpha = tl.exp(m - m_new)
        w = tl.where(ok, tl.exp(lse - m_new), 0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        w_sum = w_sum * alpha + tl.sum(w, 0)
        m = m_new
    o = acc / tl.where(w_sum > 0, w_sum, 1.0)  # w_sum >= 1 on stored rows
    tok = (q_start + row // NUM_HEADS).to(tl.int64)
    head = row % NUM_HEADS
    store = v_ok & ((offs_v * 0 + n) > 0)  # (a tensor: the interpreter rejects scalar & tensor masks)
    tl.store(OUT + tok * stride_ot + head * stride_oh + offs_v, o.to(OUT.dtype.element_ty), mask=store)


def mla_merge(
    plan: MLAPlan,
    part_o: torch.Tensor,  # fp32 [NI, BLOCK_M, BLOCK_R] from mla_split_attention
    part_lse: torch.Tensor,  # fp32 [NI, BLOCK_M]
    out: torch.Tensor,  # [T, H, r]: rows of merged tiles are written
    dims: KernelDims,
) -> torch.Tensor:
    if plan.num_merge_tiles == 0:
        return out
    want = (plan.num_items, dims.block_m, dims.block_r)
    if part_o.shape != want or part_o.dtype != torch.float32 or not part_o.is_contiguous():
        raise ValueError(f"part_o must be contiguous fp32 {want}, got {part_o.dtype} {tuple(part_o.shape)}")
    if part_lse.shape != want[:2] or part_lse.dtype != torch.float32 or not part_lse.is_contiguous():
        raise ValueError(f"part_lse must be contiguous fp32 {want[:2]}, got {part_lse.dtype} "
                         f"{tuple(part_lse.shape)}")  # fmt: skip
    if out.shape != (plan.num_tokens, plan.num_heads, dims.r) or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be [{plan.num_tokens}, {plan.num_heads}, {dims.r}] with unit last stride, "
                         f"got {tuple(out.shape)} strides {out.stride()}")  # fmt: skip
    for name, t in (("part_o", part_o), ("part_lse", part_lse), ("out", out)):
        if t.device != plan.device:
            raise ValueError(f"{name} is on {t.device}, the plan on {plan.device}")
    merge_v = min(MERGE_V, dims.block_r)
    grid = (plan.num_merge_tiles * dims.block_m, triton.cdiv(dims.r, merge_v))
    _mla_merge_kernel[grid](
        plan.seqs, plan.tiles, plan.merge_tiles, part_o, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=dims.num_heads, R=dims.r, BLOCK_R=dims.block_r, BLOCK_M=dims.block_m,
        MERGE_V=merge_v, CHUNK=CHUNK, SEQ_W=SEQ_FIELDS,
    )  # fmt: skip
    return out
