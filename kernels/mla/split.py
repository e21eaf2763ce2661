"""Split-KV MLA attention: one program per work item of the plan, all heads × new tokens of a tile at once.

An item is a tile of BLOCK_M rows (token, head) of one sequence against
- a split of its committed prefix: positions [kv_start, kv_end), all visible, addressed through the slot /
  page table (a static plan's rows: their sequence's shared prefix, then their own tail); and, for the
  tile's first item (has_new),
- the tile's new tokens (their latents are already in the cache at new_slots), under the tree mask (bits)
  or causal. With key_bound the keys stop at the tile's last token.

Each latent block [BLOCK_N, r + dr] is read once and used by every row of the tile (every head of every
new token in it): scores = q_lat·c_kvᵀ + q_pe·k_peᵀ, value = c_kv. Online softmax in base 2. A tile with
one item (a prefix shorter than split_len, decode or verify at short context) writes its output
directly; otherwise each program writes its partial o (normalised) and lse (natural log) per row,

    part_o   fp32 [num_items, BLOCK_M, BLOCK_R]
    part_lse fp32 [num_items, BLOCK_M]

for mla/merge.py to combine. An idle item (a static plan's split past its row's prefix: kv_start = kv_end
and no new tokens, mla/static_plan.py) loads and stores nothing: its tile's num_parts does not count it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.kernels.checks import is_interpreted
from ddtree.kernels.mla.checks import LOG2E, KernelDims, check_inputs, kernel_dims
from ddtree.kernels.mla.plan import SEQ_FIELDS, MLAKernelConfig, MLAPlan, mla_smem_bytes, smaller_mla_configs
from ddtree.kernels.shared_memory import device_smem_budget, fit_config, launch_with_fallback

_FITTED: dict[tuple, MLAKernelConfig] = {}  # launch key -> the config that launched (launch_with_fallback)


@triton.jit
def _load_keys(KV, slot, ok, stride_kv, offs_r, r_ok, offs_d, d_ok, R: tl.constexpr, BF16_VIA_FP32: tl.constexpr):
    """c_kv [BLOCK_N, BLOCK_R] (also the value) and k_pe [BLOCK_N, BLOCK_DR] of the given slots."""
    row = KV + slot[:, None] * stride_kv
    k = tl.load(row + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
    kp = tl.load(row + R + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if BF16_VIA_FP32:
        k = k.to(tl.float32)
        kp = kp.to(tl.float32)
    return k, kp


@triton.jit
def _attend_block(q, qp, k, kp, visible, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key block; visible broadcasts to [BLOCK_M, BLOCK_N]."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.dot(qp, tl.trans(kp), s, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing in this block
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P·V in the cache dtype, as flash attention does (fp32 when interpreting bf16, see kernel_dims)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_split_kernel(
    Q_LAT, Q_PE, KV, SEQS, TILES, ITEMS, TABLE, NEW_SLOTS, MASK_BITS, PART_O, PART_LSE, OUT,
    stride_lt, stride_lh, stride_pt, stride_ph, stride_kv, stride_ot, stride_oh,
    scale_log2,
    NUM_HEADS: tl.constexpr, R: tl.constexpr, DR: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_VIA_FP32: tl.constexpr, SEQ_W: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tile = tl.load(ITEMS + pid * 4)
    has_new = tl.load(ITEMS + pid * 4 + 1)
    kv_start = tl.load(ITEMS + pid * 4 + 2)
    kv_end = tl.load(ITEMS + pid * 4 + 3)
    seq = tl.load(TILES + tile * 4)
    row_start = tl.load(TILES + tile * 4 + 1)
    num_parts = tl.load(TILES + tile * 4 + 3)
    q_start = tl.load(SEQS + seq * SEQ_W)
    q_len = tl.load(SEQS + seq * SEQ_W + 1)
    table_off = tl.load(SEQS + seq * SEQ_W + 3)
    shared_len = tl.load(SEQS + seq * SEQ_W + 7)
    tail_off = tl.load(SEQS + seq * SEQ_W + 8)

    offs_m = tl.arange(0, BLOCK_M)
    rows = row_start + offs_m
    idle = (kv_end <= kv_start) & (has_new == 0)  # no keys: no rows (nothing loaded, nothing stored)
    n_rows = tl.where(idle, 0, q_len * NUM_HEADS)
    row_ok = rows < n_rows
    node = rows // NUM_HEADS  # the row's new token, within the sequence
    tok = (q_start + node).to(tl.int64)
    head = rows % NUM_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < R
    d_ok = offs_d < DR
    q = tl.load(
        Q_LAT + tok[:, None] * stride_lt + head[:, None] * stride_lh + offs_r[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_R]
    qp = tl.load(
        Q_PE + tok[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_DR]
    if BF16_VIA_FP32:
        q = q.to(tl.float32)
        qp = qp.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):  # the prefix split (empty range: none)
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < kv_end
        if PAGE_SIZE == 1:  # the shared prefix, then the row's own tail (plan_mla: shared_len = prefix_len)
            at = tl.where(pos < shared_len, table_off + pos, tail_off + (pos - shared_len))
            slot = tl.load(TABLE + at, mask=ok, other=0).to(tl.int64)
        else:
            page = tl.load(TABLE + table_off + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
        k, kp = _load_keys(KV, slot, ok, stride_kv, offs_r, r_ok, offs_d, d_ok, R, BF16_VIA_FP32)
        m_i, l_i, acc = _attend_block(q, qp, k, kp, ok[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION)

    mask_off = tl.load(SEQS + seq * SEQ_W + 4)
    key_bound = tl.load(SEQS + seq * SEQ_W + 5)
    mask_words = tl.load(SEQS + seq * SEQ_W + 6)
    explicit = (rows * 0 + mask_off) >= 0  # [BLOCK_M] (a tensor: the interpreter rejects scalar & tensor)
    last_node = (tl.minimum(row_start + BLOCK_M, n_rows) - 1) // NUM_HEADS
    key_end = tl.where(has_new != 0, tl.where(key_bound != 0, last_node + 1, q_len), 0)
    for start in range(0, key_end, BLOCK_N):  # the new tokens under the mask (key_end 0: none)
        j = start + tl.arange(0, BLOCK_N)
        ok = j < key_end
        slot = tl.load(NEW_SLOTS + q_start + j, mask=ok, other=0).to(tl.int64)
        k, kp = _load_keys(KV, slot, ok, stride_kv, offs_r, r_ok, offs_d, d_ok, R, BF16_VIA_FP32)
        word = tl.load(
            MASK_BITS + mask_off + node[:, None] * mask_words + (j // 32)[None, :],
            mask=(row_ok & explicit)[:, None] & ok[None, :],
            other=0,
        )
        bit = ((word >> (j % 32)[None, :]) & 1) != 0
        visible = tl.where(explicit[:, None], bit, j[None, :] <= node[:, None]) & ok[None, :]
        m_i, l_i, acc = _attend_block(q, qp, k, kp, visible, m_i, l_i, acc, scale_log2, DOT_PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.0)  # every stored row saw >= 1 key (itself, or the split's)
    o = acc / l_i[:, None]
    if num_parts == 1:  # the tile's only item: this is its output
        tl.store(
            OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_r[None, :],
            o.to(OUT.dtype.element_ty),
            mask=row_ok[:, None] & r_ok[None, :],
        )
    else:
        part = pid.to(tl.int64) * BLOCK_M
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base-2 lse -> natural log (ln 2)
        tl.store(PART_O + (part + offs_m[:, None]) * BLOCK_R + offs_r[None, :], o, mask=row_ok[:, None])
        tl.store(PART_LSE + part + offs_m, lse, mask=row_ok)


def mla_split_attention(
    q_lat: torch.Tensor,  # [T, H, r]
    q_pe: torch.Tensor,  # [T, H, dr]
    kv: torch.Tensor,  # [S, r + dr] one layer's latent cache, new tokens already written
    plan: MLAPlan,
    scale: float,
    out: torch.Tensor,  # [T, H, r]: rows of single-item tiles are written here
    dims: KernelDims | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # part_o fp32 [NI, BLOCK_M, BLOCK_R], part_lse fp32 [NI, BLOCK_M]
    """Run every work item; partials of tiles with several items are returned for mla_merge."""
    check_inputs(q_lat, q_pe, kv, plan)
    d = dims or kernel_dims(q_lat, q_pe, plan, is_interpreted(_mla_split_kernel))
    if out.shape != q_lat.shape or out.device != plan.device or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q_lat.shape)} on {plan.device} with unit last stride, got "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    n_parts = plan.num_items if plan.num_merge_tiles else 0  # partials are only written for merged tiles
    part_o = torch.empty(n_parts, d.block_m, d.block_r, dtype=torch.float32, device=plan.device)
    part_lse = torch.empty(n_parts, d.block_m, dtype=torch.float32, device=plan.device)
    if plan.num_items == 0:
        return part_o, part_lse

    def launch(c: MLAKernelConfig) -> None:
        _mla_split_kernel[(plan.num_items,)](
            q_lat, q_pe, kv, plan.seqs, plan.tiles, plan.items, plan.table, plan.new_slots, plan.mask_bits,
            part_o, part_lse, out,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), out.stride(0),
            out.stride(1), scale * LOG2E,
            NUM_HEADS=d.num_heads, R=d.r, DR=d.dr, BLOCK_R=d.block_r, BLOCK_DR=d.block_dr,
            BLOCK_M=d.block_m, BLOCK_N=c.block_n, PAGE_SIZE=plan.page_size,
            DOT_PRECISION=d.dot_precision, BF16_VIA_FP32=d.bf16_via_fp32, SEQ_W=SEQ_FIELDS,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    # The plan's config shrunk to the device's shared memory estimate, then on OutOfResources at launch.
    smem = lambda c: mla_smem_bytes(c, d.block_m, d.block_r, d.block_dr, kv.element_size())  # noqa: E731
    cfg = fit_config(plan.config, smaller_mla_configs, smem, device_smem_budget(plan.device))
    key = (cfg, d.block_m, d.block_r, d.block_dr, d.dot_precision, kv.dtype, q_lat.dtype, plan.page_size, plan.device)
    launch_with_fallback(launch, cfg, _FITTED, key, smaller_mla_configs, _describe, "mla split")
    return part_o, part_lse


def _describe(c: MLAKernelConfig) -> str:
    return f"block_n {c.block_n} w{c.num_warps} s{c.num_stages}"
