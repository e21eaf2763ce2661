"""MoE alignment: the (token, slot) pairs of a routing, grouped by local expert and padded to BLOCK_M.

A pair p = token · topk + slot routes row `token` to expert topk_ids[token, slot]; its local slot is
expert_map[id] (the id itself without a map; -1 = an expert of another rank: the pair is dropped here
and contributes nothing). The range guard: an id outside [0, E_global) or a map value outside
[-1, E) drops its pair too, so nothing reads the routing back to the host to validate it.
With count_e pairs on local expert e and padded_e = ceil(count_e / BM) · BM:

    sorted_pair_ids int32 [capacity]       expert e's pairs at [start_e, start_e + count_e) in ascending p
                                           (stable), then padded_e - count_e sentinels (= num_pairs);
                                           start_e = Σ_{e' < e} padded_e'; sentinels past num_padded too
    block_expert    int32 [capacity / BM]  the local expert of M-block b, -1 past num_padded (skipped)
    num_padded      int32 [1]              Σ_e padded_e (on the device: no host sync)
    local_ids       int32 [num_pairs]      the local slot of each pair (-1 = another rank)

capacity = ceil((num_pairs + min(E, num_pairs) · (BM - 1)) / BM) · BM bounds num_padded for any
routing, so every shape is static in (num_pairs, E, BM) and the whole alignment can run inside a CUDA
graph. Experts without pairs take no block.

moe_align runs three small Triton kernels (no atomics, so the result is deterministic):
  1. count   grid (C,):  local_ids, and per chunk of CHUNK pairs its pairs per expert  counts [C, E];
  2. offsets grid (1,):  start_e, each chunk's first destination per expert  base [C, E] (an
             exclusive prefix over chunks), the end block of each expert, num_padded, the pad sentinels;
  3. scatter grid (max(C, B),): program c writes chunk c's pairs to base[c, e] + their rank among the
             chunk's earlier pairs of e; program b writes block_expert for BLOCK_B blocks (and the
             sentinels of the blocks past num_padded).
moe_align_torch is its twin in torch ops (also graph-safe: no bincount, no nonzero), equal element for element.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ddtree.kernels.moe.weights import local_slots


@dataclasses.dataclass(frozen=True)
class MoeAlignment:
    sorted_pair_ids: torch.Tensor  # int32 [capacity]
    block_expert: torch.Tensor  # int32 [capacity // block_m]
    num_padded: torch.Tensor  # int32 [1]
    local_ids: torch.Tensor  # int32 [num_pairs]
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The largest num_padded any routing of num_pairs pairs over num_experts experts can give."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def _sub_chunk(block_e: int) -> int:
    return max(1, min(64, 4096 // block_e))  # one-hot tiles [SUB, BLOCK_E] of <= 4096 elements


@triton.jit
def _count_kernel(
    IDS, EXPERT_MAP, LOCAL, COUNTS, num_pairs, num_global,
    E: tl.constexpr, HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for s in range(0, tl.minimum(CHUNK, num_pairs - c * CHUNK), SUB):
        p = c * CHUNK + s + tl.arange(0, SUB)
        ok = p < num_pairs
        ids = tl.load(IDS + p, mask=ok, other=0)
        valid = ok & (ids >= 0) & (ids < num_global)  # the range guard: an id out of range is dropped
        if HAS_MAP:
            loc = tl.load(EXPERT_MAP + ids, mask=valid, other=-1).to(tl.int32)
        else:
            loc = ids.to(tl.int32)
        loc = tl.where(valid & (loc >= 0) & (loc < E), loc, -1)
        tl.store(LOCAL + p, loc, mask=ok)
        counts += tl.sum((loc[:, None] == offs_e[None, :]).to(tl.int32), 0)
    tl.store(COUNTS + c * E + offs_e, counts, mask=offs_e < E)


@triton.jit
def _offsets_kernel(
    COUNTS, BASE, BLOCK_END, NUM_PADDED, SORTED, num_chunks, num_pairs,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, PAD_TILE: tl.constexpr,
):  # fmt: skip
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_c = tl.arange(0, BLOCK_C)
    total = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):  # pass 1: pairs per expert
        ok = ((c0 + offs_c) < num_chunks)[:, None] & e_ok[None, :]
        total += tl.sum(tl.load(COUNTS + (c0 + offs_c)[:, None] * E + offs_e[None, :], mask=ok, other=0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded  # [BLOCK_E] exclusive prefix over experts
    tl.store(BLOCK_END + offs_e, end // BLOCK_M, mask=e_ok)
    tl.store(NUM_PADDED, tl.sum(padded, 0))
    run = start
    for c0 in range(0, num_chunks, BLOCK_C):  # pass 2: each chunk's first slot per expert
        ok = ((c0 + offs_c) < num_chunks)[:, None] & e_ok[None, :]
        cnt = tl.load(COUNTS + (c0 + offs_c)[:, None] * E + offs_e[None, :], mask=ok, other=0)
        incl = tl.cumsum(cnt, 0)
        tl.store(BASE + (c0 + offs_c)[:, None] * E + offs_e[None, :], run[None, :] + incl - cnt, mask=ok)
        run += tl.sum(cnt, 0)
    for j0 in range(0, BLOCK_M, PAD_TILE):  # the pads of each expert: [start + count, start + padded)
        j = j0 + tl.arange(0, PAD_TILE)
        pos = (start + total)[:, None] + j[None, :]
        pad_ok = e_ok[:, None] & (pos < (start + padded)[:, None])
        tl.store(SORTED + pos, tl.zeros([BLOCK_E, PAD_TILE], tl.int32) + num_pairs, mask=pad_ok)


@triton.jit
def _scatter_kernel(
    LOCAL, BASE, BLOCK_END, SORTED, BLOCK_EXPERT, num_pairs, num_chunks, num_blocks,
    E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    if pid < num_chunks:  # the chunk's pairs, stable within each expert
        base = tl.load(BASE + pid * E + offs_e, mask=e_ok, other=0)  # [BLOCK_E] next free slot per expert
        i = tl.arange(0, SUB)
        earlier = i[None, :] < i[:, None]  # [SUB, SUB]: j before i
        for s in range(0, tl.minimum(CHUNK, num_pairs - pid * CHUNK), SUB):
            p = pid * CHUNK + s + i
            loc = tl.load(LOCAL + p, mask=p < num_pairs, other=-1)
            hot = loc[:, None] == offs_e[None, :]  # [SUB, BLOCK_E]
            first = tl.sum(tl.where(hot, base[None, :], 0), 1)
            rank = tl.sum((earlier & (loc[:, None] == loc[None, :])).to(tl.int32), 1)
            tl.store(SORTED + first + rank, p, mask=loc >= 0)
            base += tl.sum(hot.to(tl.int32), 0)
    if pid * BLOCK_B < num_blocks:  # block b belongs to the first expert whose end block is > b
        b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
        end = tl.load(BLOCK_END + offs_e, mask=e_ok, other=2147483647)
        e = tl.sum((end[None, :] <= b[:, None]).to(tl.int32), 1)
        e = tl.where(e < E, e, -1)
        tl.store(BLOCK_EXPERT + b, e, mask=b < num_blocks)
        r = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # sentinels past num_padded
        tl.store(
            SORTED + r, tl.zeros([BLOCK_B, BLOCK_M], tl.int32) + num_pairs, mask=((e < 0) & (b < num_blocks))[:, None]
        )


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"moe align: topk_ids must be int32 / int64 [M, k], got {topk_ids.dtype} {list(topk_ids.shape)}"
        )
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"moe align: num_experts and block_m must be >= 1, got {num_experts} / {block_m}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"moe align: expert_map must be int32 / int64 [E_global], got {expert_map.dtype} "
                         f"{list(expert_map.shape)}")  # fmt: skip


def moe_align(
    topk_ids: torch.Tensor,  # int [M, k]: global expert ids (out of range: dropped)
    num_experts: int,  # E: local experts
    block_m: int,
    expert_map: torch.Tensor | None = None,  # int [E_global]: local slot or -1
) -> MoeAlignment:
    _check(topk_ids, num_experts, block_m, expert_map)
    dev = topk_ids.device
    P = topk_ids.numel()
    cap = capacity(P, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    sub = _sub_chunk(block_e)
    chunk = max(256, triton.next_power_of_2(triton.cdiv(P, 128)))  # at most ~128 chunks
    num_chunks = max(1, triton.cdiv(P, chunk))
    num_blocks = cap // block_m
    block_b = max(1, min(64, 4096 // block_e))
    local = torch.empty(P, dtype=torch.int32, device=dev)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    block_end = torch.empty(num_experts, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    emap = ids if expert_map is None else expert_map  # a placeholder pointer when there is no map
    _count_kernel[(num_chunks,)](
        ids, emap, local, counts, P, num_experts if expert_map is None else expert_map.shape[0], E=num_experts,
        HAS_MAP=expert_map is not None, CHUNK=chunk, SUB=sub, BLOCK_E=block_e,
    )  # fmt: skip
    _offsets_kernel[(1,)](
        counts, base, block_end, num_padded, sorted_ids, num_chunks, P, E=num_experts, BLOCK_M=block_m,
        BLOCK_E=block_e, BLOCK_C=max(1, min(16, 4096 // block_e)), PAD_TILE=min(block_m, max(1, 4096 // block_e)),
        num_warps=8,
    )  # fmt: skip
    grid = max(num_chunks, triton.cdiv(num_blocks, block_b))
    _scatter_kernel[(grid,)](
        local, base, block_end, sorted_ids, block_expert, P, num_chunks, num_blocks, E=num_experts,
        BLOCK_M=block_m, CHUNK=chunk, SUB=sub, BLOCK_E=block_e, BLOCK_B=block_b,
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_expert, num_padded, local, block_m, P)


def moe_align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> MoeAlignment:
    """moe_align in torch ops: the same tensors, element for element."""
    _check(topk_ids, num_experts, block_m, expert_map)
    dev = topk_ids.device
    P = topk_ids.numel()
    cap = capacity(P, num_experts, block_m)
    local = local_slots(topk_ids, num_experts, expert_map)  # [P], -1: another rank's or out of range
    key = torch.where(local >= 0, local, num_experts)  # non-local pairs sort last, into a spare bin
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    end = padded.cumsum(0)
    start = end - padded
    order = torch.sort(key, stable=True).indices  # pair ids grouped by expert, ascending within
    first = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [E + 1] first sorted position of each expert
    sorted_key = key[order]
    rank = torch.arange(P, device=dev) - first[sorted_key]
    keep = sorted_key < num_experts
    dest = torch.where(keep, start[sorted_key.clamp(max=num_experts - 1)] + rank, cap)  # cap = a spare slot
    sorted_ids = torch.full((cap + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(cap // block_m, device=dev)
    block_expert = torch.searchsorted(end // block_m, blocks, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = end[-1:].to(torch.int32)
    return MoeAlignment(sorted_ids[:cap], block_expert, num_padded, local.to(torch.int32), block_m, P)
