"""Torch references for the kernels in this package (test oracles; fp32 math, loops over sequences).

Every function mirrors one kernel wrapper's arguments, so a test calls both with the same inputs.
"""

from __future__ import annotations

import torch

from ddtree.kernels.mla.plan import MLAPlan, MLASeq


def prefix_slots(seq: MLASeq, page_size: int) -> torch.Tensor:
    """int64 [P]: the cache slot of each prefix position, slot(p) = table[p // ps] · ps + p % ps."""
    p = torch.arange(seq.prefix_len)
    table = seq.prefix_table.to("cpu", torch.int64)
    return table[p // page_size] * page_size + p % page_size  # [P]


def decode_rows_ref(seqs: list[MLASeq], page_size: int) -> list[MLASeq]:
    """The sequences a row-invariant plan's tiles index (mla/plan.py _decode_rows), one row at a time: every
    new token a decode row (q_len 1, slot tables) over its sequence's prefix and then the other new tokens
    it sees in row order (causal: the earlier ones; a mask: its row's)."""
    rows = []
    for s in seqs:
        table, new = prefix_slots(s, page_size), s.new_slots.to("cpu", torch.int64)
        sees = s.new_mask.cpu() if s.new_mask is not None else torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril()
        for j in range(s.q_len):
            seen = new[sees[j] & (torch.arange(s.q_len) != j)]
            rows.append(MLASeq(1, table.numel() + seen.numel(), torch.cat([table, seen]), new[j : j + 1]))
    return rows


def mla_attention_ref(
    q_lat: torch.Tensor,  # [T, H, r]
    q_pe: torch.Tensor,  # [T, H, dr]
    kv: torch.Tensor,  # [S, r + dr]
    seqs: list[MLASeq],
    scale: float,
    page_size: int = 1,
) -> torch.Tensor:  # o_lat [T, H, r], dtype of q_lat
    r = q_lat.shape[2]
    q = torch.cat([q_lat, q_pe], dim=-1).float().cpu()  # [T, H, r+dr]
    cache = kv.float().cpu()
    out = torch.zeros(q_lat.shape, dtype=torch.float32)
    row = 0
    for s in seqs:
        rows = slice(row, row + s.q_len)
        row += s.q_len
        if s.q_len == 0:
            continue
        slots = torch.cat([prefix_slots(s, page_size), s.new_slots.cpu()])  # [P+q]
        keys = cache[slots]  # [P+q, r+dr]
        scores = torch.einsum("qhc,kc->hqk", q[rows], keys) * scale  # [H, q, P+q]
        visible = torch.ones(s.q_len, s.prefix_len + s.q_len, dtype=torch.bool)  # [q, P+q]
        new = s.new_mask.cpu() if s.new_mask is not None else torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril()
        visible[:, s.prefix_len :] = new
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [H, q, P+q]
        out[rows] = torch.einsum("hqk,kc->qhc", probs, keys[:, :r])  # [q, H, r]
    return out.to(q_lat.dtype).to(q_lat.device)


def mla_split_partials_ref(
    q_lat: torch.Tensor,  # [T, H, r]
    q_pe: torch.Tensor,  # [T, H, dr]
    kv: torch.Tensor,  # [S, r + dr]
    seqs: list[MLASeq],
    plan: MLAPlan,
    scale: float,
    block_r: int,
    page_size: int = 1,  # of the seqs' tables (a row-invariant plan may have expanded them to slots)
) -> tuple[torch.Tensor, torch.Tensor]:  # part_o fp32 [NI, BLOCK_M, block_r], part_lse fp32 [NI, BLOCK_M]
    """What mla_split_attention computes for each plan item: a softmax over that item's keys only
    (a prefix split's range, plus the new tokens under the mask for has_new). Rows past the end are NaN."""
    T, H, r = q_lat.shape
    bm, ps = plan.block_m, page_size
    if plan.config.row_invariant:  # the tiles index rows planned as decodes (slot tables)
        seqs, ps = decode_rows_ref(seqs, page_size), 1
    q = torch.cat([q_lat, q_pe], dim=-1).float().cpu().reshape(T * H, -1)  # [T·H, r+dr], row = t·H + h
    cache = kv.float().cpu()
    tiles = plan.tiles.cpu().tolist()
    part_o = torch.full((plan.num_items, bm, block_r), float("nan"))
    part_lse = torch.full((plan.num_items, bm), float("nan"))
    q_starts = [sum(s.q_len for s in seqs[:b]) for b in range(len(seqs))]
    for i, (tile, has_new, k0, k1) in enumerate(plan.items.cpu().tolist()):
        b, row0 = tiles[tile][:2]
        s = seqs[b]
        n = min(bm, s.q_len * H - row0)
        rows = torch.arange(row0, row0 + n)  # [n] rows within the sequence
        slots = prefix_slots(s, ps)[k0:k1]  # [k1-k0]
        visible = torch.ones(n, k1 - k0, dtype=torch.bool)
        if has_new:
            new = s.new_mask.cpu() if s.new_mask is not None else torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril()
            slots = torch.cat([slots, s.new_slots.cpu()])  # [k1-k0+q]
            visible = torch.cat([visible, new[rows // H]], dim=1)  # [n, k1-k0+q]
        keys = cache[slots]  # [n_keys, r+dr]
        scores = (q[q_starts[b] * H + rows] @ keys.T * scale).masked_fill(~visible, float("-inf"))  # [n, n_keys]
        lse = torch.logsumexp(scores, dim=-1)  # [n]
        part_lse[i, :n] = lse
        part_o[i, :n, :r] = (scores - lse[:, None]).exp() @ keys[:, :r]  # [n, r]
        part_o[i, :n, r:] = 0.0
    return part_o, part_lse


def write_latent_ref(
    kv: torch.Tensor,  # [S, r + dr] written in place
    latent: torch.Tensor,  # [T, r + dr] kv_a_proj_with_mqa output: [c_kv (not normalised) ; k_pe (not rotated)]
    slots: torch.Tensor,  # int64 [T]
    positions: torch.Tensor,  # int64 [T]
    norm_weight: torch.Tensor,  # [r]
    eps: float,
    inv_freq: torch.Tensor,  # fp32 [dr / 2]
    attention_factor: float = 1.0,
) -> None:
    """kv[slots] = [RMSNorm(c_kv) ; RoPE(k_pe)] exactly as mla.py's project_latent + scatter does it."""
    r = norm_weight.shape[0]
    c, pe = latent[:, :r], latent[:, r:]
    cf = c.float()
    normed = norm_weight * (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + eps)).to(c.dtype)  # [T, r]
    angles = positions.float()[:, None] * inv_freq.float().to(latent.device)  # [T, dr/2]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    pf = pe.float().unflatten(-1, (-1, 2))  # [T, dr/2, 2] interleaved pairs
    even, odd = pf[..., 0], pf[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(pe.dtype)
    kv[slots.to(kv.device)] = torch.cat([normed, rotated], dim=-1).to(kv.dtype)
