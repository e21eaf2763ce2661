"""Absorbed-MLA attention over a latent cache: tree verify, decode and prefill / extend in one call.

    o_lat[t, h] = Σ_s softmax_s((q_lat[t, h]·c_kv[s] + q_pe[t, h]·k_pe[s]) · scale) · c_kv[s]

over the sequence's prefix slots (all visible) and its new tokens (under the mask). The three uses differ
only in the plan (mla/plan.py):
- tree verify: q_len = nodes + 1, new_mask = ancestor mask (bits);
- decode:      q_len = 1 (a one-node tree: the same two kernels, the new part is the token itself);
- prefill / extend over a cached prefix: q_len = chunk, new_mask None (causal).

At most two launches: mla/split.py (every (row tile, prefix split) item in parallel, a tile's first item
also attending to its new tokens; a tile with one item writes its output directly) and mla/merge.py (LSE
merge of the partials of the other tiles; skipped when there are none, i.e. at short context).
"""

from __future__ import annotations

import torch

from ddtree.kernels.checks import is_interpreted
from ddtree.kernels.mla.checks import check_inputs, kernel_dims
from ddtree.kernels.mla.merge import mla_merge
from ddtree.kernels.mla.plan import MLAPlan
from ddtree.kernels.mla.split import _mla_split_kernel, mla_split_attention


def mla_attention(
    q_lat: torch.Tensor,  # [T, H, r]  q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, H, dr] rotated
    kv: torch.Tensor,  # [S, r + dr] one layer's cache: [c_kv ; k_pe] per slot, new tokens already written
    plan: MLAPlan,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # o_lat [T, H, r], dtype of q_lat
    check_inputs(q_lat, q_pe, kv, plan)
    dims = kernel_dims(q_lat, q_pe, plan, is_interpreted(_mla_split_kernel))
    if out is None:
        out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    elif out.shape != q_lat.shape or out.dtype != q_lat.dtype or out.device != q_lat.device:
        raise ValueError(f"out must be {q_lat.dtype} {tuple(q_lat.shape)} on {q_lat.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")  # fmt: skip
    dst = out.float() if dims.bf16_via_fp32 else out  # see kernel_dims: there torch rounds to bf16
    part_o, part_lse = mla_split_attention(q_lat, q_pe, kv, plan, scale, dst, dims)
    mla_merge(plan, part_o, part_lse, dst, dims)
    if dst is not out:
        out.copy_(dst)
    return out
