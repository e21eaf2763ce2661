"""The MoE's torch path (CPU, and CUDA without the Triton kernel): no Python loop over experts.

`grouped_moe(x, gate, up, down, topk_weights, topk_ids, expert_map)` takes the arguments of
`ddtree.kernels.fused_moe.fused_moe` (the weights as kernels/moe_weights.py `ExpertWeights`) and equals
`kernels/moe_reference.py` (the per-expert loop, kept as the test oracle):

1. the M·k (token, choice) assignments are sorted by local expert (another rank's, slot -1, dropped);
   their rows are gathered once: xs [A, d], assignment a of expert e in rows offs[e-1]..offs[e];
2. per projection one matmul over all local experts: `torch._grouped_mm(xs, W [E, K, N], offs)` for
   bf16 weights as they are; int4 / fp8 weights are dequantized (fp32, then the compute dtype) for the
   experts that got a row, in blocks of at most DEQUANT_ELEMENTS weights, one grouped matmul per block;
3. silu(gate) · up, down, times the routing weight (fp32), index_add into the output rows (fp32).

The compute dtype is x's (the autocast dtype under CPU autocast); bf16 weights of another dtype are cast.
Differentiable for bf16 weights (training uses this path). METHOD "bmm" is a padded batched matmul over
the experts present instead (kept for devices without `_grouped_mm` and for the comparison).

Chosen by measurement (`python -m scripts.bench.bench_moe_cpu --threads 1`; the table is in docs/performance.md):
`_grouped_mm` is as fast as the per-expert loop or faster for plain weights and never slower than the padded bmm
beyond a handful of rows (padding grows with skewed routing), so it is CPU_METHOD.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.kernels.moe_weights import ExpertWeights, check_routing
from ddtree.kernels.quant_formats import dequantize_fp8_block, dequantize_int4

DEQUANT_ELEMENTS = 1 << 26  # at most this many dequantized expert weights per projection at once
HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
CPU_METHOD = "grouped_mm" if HAS_GROUPED_MM else "bmm"


def grouped_moe(
    x: torch.Tensor,  # [M, d]
    gate: ExpertWeights,  # [E, I, d]
    up: ExpertWeights,  # [E, I, d]
    down: ExpertWeights,  # [E, d, I]
    topk_weights: torch.Tensor,  # float [M, k]
    topk_ids: torch.Tensor,  # int [M, k] global expert ids
    expert_map: torch.Tensor | None = None,  # int32 [E_global]: local slot or -1
    method: str | None = None,  # "grouped_mm" | "bmm"; None = CPU_METHOD on the CPU, "bmm" elsewhere
) -> torch.Tensor:  # [M, d], dtype of x
    E = gate.num_experts
    check_routing(topk_ids, topk_weights, x.shape[0], E if expert_map is None else expert_map.shape[0], expert_map)
    method = method or (CPU_METHOD if x.device.type == "cpu" else "bmm")
    if method == "grouped_mm" and not HAS_GROUPED_MM:
        raise ValueError("this torch build has no torch._grouped_mm")
    M, k = topk_ids.shape
    ids = topk_ids.long()
    flat = (ids if expert_map is None else expert_map.long()[ids]).flatten()  # [M*k] local slot per assignment
    order = flat.argsort(stable=True)  # assignments by local slot, ties in token order; slot -1 first
    if expert_map is not None:
        order = order[int((flat < 0).sum()) :]
    slots = flat.index_select(0, order)  # [A] ascending
    rows = order // k  # [A] token row of each assignment
    counts = torch.bincount(slots, minlength=E)  # [E]
    dt = torch.get_autocast_dtype("cpu") if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") else x.dtype
    xs = x.index_select(0, rows).to(dt)  # [A, d]
    with torch.autocast(x.device.type, enabled=False):
        h = F.silu(_project(xs, gate, counts, method)) * _project(xs, up, counts, method)  # [A, I]
        ys = _project(h, down, counts, method).float() * topk_weights.flatten().index_select(0, order)[:, None]
    out = torch.zeros(M, down.out_features, dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, ys.float()).to(x.dtype)


def _project(xs: torch.Tensor, w: ExpertWeights, counts: torch.Tensor, method: str) -> torch.Tensor:
    """xs [A, K] sorted by expert (counts [E] rows each) -> [A, N]: row a times W_{expert(a)}ᵀ."""
    A, dt = xs.shape[0], xs.dtype
    if method == "grouped_mm" and (w.in_features * dt.itemsize % 16 or w.out_features * dt.itemsize % 16):
        method = "bmm"  # _grouped_mm needs rows of whole 16-byte units (true of every real model's widths)
    if w.kind == "bf16":
        if method == "grouped_mm":
            return _grouped(xs, w.weight.to(dt), counts)
        present = counts.nonzero().flatten()
        return _padded(xs, w.weight.to(dt).index_select(0, present), counts.index_select(0, present))
    out = xs.new_empty(A, w.out_features)
    present = counts.nonzero().flatten().tolist()
    per_block = max(1, DEQUANT_ELEMENTS // max(1, w.out_features * w.in_features))
    ends = counts.cumsum(0).tolist()
    for b in range(0, len(present), per_block):  # one block for every layer that fits DEQUANT_ELEMENTS
        block = present[b : b + per_block]
        r0, r1 = ends[block[0]] - int(counts[block[0]]), ends[block[-1]]  # the block's rows are contiguous
        idx = torch.tensor(block, device=xs.device)
        wb = _dequantize(w, idx).to(dt)  # [P, N, K]
        n = counts.index_select(0, idx)
        part = xs[r0:r1]
        out[r0:r1] = _grouped(part, wb, n) if method == "grouped_mm" else _padded(part, wb, n)
    return out


def _grouped(xs: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """xs [A, K], weight [G, N, K], counts [G] (sum A) -> [A, N] in one grouped matmul."""
    offs = counts.cumsum(0).to(torch.int32)
    return torch._grouped_mm(xs, weight.transpose(1, 2), offs=offs)


def _padded(xs: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as a batched matmul over [G, max(counts), K] zero-padded row blocks."""
    G, A = weight.shape[0], xs.shape[0]
    if A == 0:
        return xs.new_zeros(0, weight.shape[1])
    group = torch.repeat_interleave(torch.arange(G, device=xs.device), counts)  # [A]
    pos = torch.arange(A, device=xs.device) - (counts.cumsum(0) - counts).index_select(0, group)  # [A]
    padded = xs.new_zeros(G, int(counts.max()), xs.shape[1])
    padded = padded.index_put((group, pos), xs)
    return torch.bmm(padded, weight.transpose(1, 2))[group, pos]


def _dequantize(w: ExpertWeights, experts: torch.Tensor) -> torch.Tensor:
    """fp32 [P, N, K] of local experts `experts` (int64 [P])."""
    q, s = w.weight.index_select(0, experts), w.scale.index_select(0, experts)
    if w.kind == "int4":
        return dequantize_int4(q, s, w.group_size, w.in_features)
    return dequantize_fp8_block(q, s, w.block)
