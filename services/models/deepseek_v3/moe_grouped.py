"""The MoE's torch path (CPU, and CUDA without the Triton kernel): no Python loop over experts.

`grouped_moe(x, gate, up, down, topk_weights, topk_ids, expert_map)` takes the arguments of
`ddtree.kernels.moe.fused.fused_moe` (the weights as kernels/moe/weights.py `ExpertWeights`) and equals
`kernels/moe/reference.py` (the per-expert loop, kept as the test oracle):

1. the M·k (token, choice) assignments are sorted by local expert (another rank's, slot -1, or an id
   out of range: past the last group, never computed, added into a spare row); their rows are gathered
   once: xs [A, d], assignment a of expert e in rows offs[e-1]..offs[e];
2. per projection one matmul over all local experts: `torch._grouped_mm(xs, W [E, K, N], offs)` for
   bf16 weights as they are; int4 / fp8 weights are dequantized (fp32, then the compute dtype) for
   min(E, M·k) experts chosen on the device (those with rows first: every expert with a row is among
   them), in blocks of at most DEQUANT_ELEMENTS fp32 weights, then one grouped matmul;
3. silu(gate) · up, down, times the routing weight (fp32), index_add into the output rows (fp32).

The compute dtype is x's (the autocast dtype under CPU autocast); bf16 weights of another dtype are cast.
Differentiable for bf16 weights (training uses this path). METHOD "bmm" is a padded batched matmul over
the chosen experts instead, M·k rows each (kept for devices without `_grouped_mm` and for the comparison).
No value is read back to the host: every shape follows from (M, k, E) (issue 40).

Chosen by measurement (`python -m scripts.bench.bench_moe_cpu --threads 1`; the table is in docs/performance.md):
`_grouped_mm` is as fast as the per-expert loop or faster for plain weights and never slower than the padded bmm
beyond a handful of rows (padding grows with skewed routing), so it is CPU_METHOD.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddtree.kernels.moe.weights import ExpertWeights, check_routing, local_slots

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
    check_routing(topk_ids, topk_weights, x.shape[0], E if expert_map is None else expert_map.shape[0], expert_map, E)
    method = method or (CPU_METHOD if x.device.type == "cpu" else "bmm")
    if method == "grouped_mm" and not HAS_GROUPED_MM:
        raise ValueError("this torch build has no torch._grouped_mm")
    M, k = topk_ids.shape
    if M * k == 0:
        return x.new_zeros(M, down.out_features)
    key = local_slots(topk_ids, E, expert_map)  # [A = M·k] local slot per assignment, -1 = dropped
    key = torch.where(key >= 0, key, E)  # dropped assignments sort last, past every group
    order = key.argsort(stable=True)  # assignments by local slot, ties in token order
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))[:E]
    # Rows of dropped assignments lie past the last group: never computed, sent to a spare output row M.
    rows = torch.where(key.index_select(0, order) < E, order // k, M)  # [A]
    groups = _Groups(counts, min(E, M * k))
    dt = torch.get_autocast_dtype("cpu") if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") else x.dtype
    xs = x.index_select(0, order // k).to(dt)  # [A, d]
    with torch.autocast(x.device.type, enabled=False):
        h = F.silu(_project(xs, gate, groups, method)) * _project(xs, up, groups, method)  # [A, I]
        ys = _project(h, down, groups, method).float() * topk_weights.flatten().index_select(0, order)[:, None]
    out = torch.zeros(M + 1, down.out_features, dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, ys.float())[:M].to(x.dtype)


class _Groups:
    """The local experts a projection runs, chosen without reading the routing back. `counts` [E]: rows per
    local expert, all E groups in slot order (bf16 weights under _grouped_mm: empty groups cost nothing and
    the weights are not copied). `experts` / `sel_counts`: the first `size` = min(E, M·k) experts in the
    stable order "has rows, then has none" (at most M·k experts can have rows, so every one with rows is
    among them, in ascending slot order: the order of the sorted rows); only their weights are gathered,
    dequantized for int4 / fp8. `experts` is None when size == E (all of them, in order)."""

    def __init__(self, counts: torch.Tensor, size: int):
        self.counts, self.size = counts, size
        if size >= counts.shape[0]:
            self.experts, self.sel_counts = None, counts
        else:
            self.experts = (counts == 0).to(torch.int8).argsort(stable=True)[:size]
            self.sel_counts = counts.index_select(0, self.experts)

    def weights(self, w: ExpertWeights, dt: torch.dtype, every: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [G, N, K] in dt, rows per group [G]): all E experts when `every` (bf16 only), else the
        selected ones (dequantized for int4 / fp8)."""
        if not w.fmt.packed:
            if every or self.experts is None:
                return w.weight.to(dt), self.counts
            return w.weight.index_select(0, self.experts).to(dt), self.sel_counts
        return _dequantize_blocks(w, self.experts, self.size, dt), self.sel_counts


def _project(xs: torch.Tensor, w: ExpertWeights, groups: _Groups, method: str) -> torch.Tensor:
    """xs [A, K] sorted by local expert (the rows past the last group are not computed: their output rows are
    left unset) -> [A, N]: row a times W_{expert(a)}ᵀ."""
    dt = xs.dtype
    if method == "grouped_mm" and (w.in_features * dt.itemsize % 16 or w.out_features * dt.itemsize % 16):
        method = "bmm"  # _grouped_mm needs rows of whole 16-byte units (true of every real model's widths)
    weight, counts = groups.weights(w, dt, every=method == "grouped_mm")
    if method == "grouped_mm":
        return torch._grouped_mm(xs, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    return _padded(xs, weight, counts)


def _padded(xs: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as a batched matmul over [G, A, K] zero-padded row blocks (A rows each: as many as any expert
    can have, so the shape does not depend on the routing; the rows past the last group go to a spare block)."""
    G, A = weight.shape[0], xs.shape[0]
    if A == 0:
        return xs.new_zeros(0, weight.shape[1])
    ends = counts.cumsum(0)
    row = torch.arange(A, device=xs.device)
    group = torch.searchsorted(ends, row, right=True)  # [A]; G past the last group
    pos = row - (ends - counts).index_select(0, group.clamp(max=G - 1))  # [A] row within its group
    pos = torch.where(group < G, pos, row)
    padded = xs.new_zeros(G + 1, A, xs.shape[1])
    padded = padded.index_put((group, pos), xs)
    return torch.bmm(padded[:G], weight.transpose(1, 2))[group.clamp(max=G - 1), pos]


def _dequantize_blocks(w: ExpertWeights, experts: torch.Tensor | None, size: int, dt: torch.dtype) -> torch.Tensor:
    """[size, N, K] in dt: local experts `experts` (int64 [size]; None = all, in order) dequantized in blocks
    of at most DEQUANT_ELEMENTS fp32 weights, each written into the result (blocks over experts, not rows:
    nothing depends on the routing's values)."""
    per_block = max(1, DEQUANT_ELEMENTS // max(1, w.out_features * w.in_features))
    if size <= per_block:
        return _dequantize(w, experts, 0, size).to(dt)
    out = torch.empty(size, w.out_features, w.in_features, dtype=dt, device=w.weight.device)
    for lo in range(0, size, per_block):
        hi = min(size, lo + per_block)
        out[lo:hi] = _dequantize(w, experts, lo, hi)
    return out


def _dequantize(w: ExpertWeights, experts: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """fp32 [hi - lo, N, K]: local experts experts[lo:hi] (None: experts lo..hi-1)."""
    if experts is None:
        q, s = w.weight[lo:hi], w.scale[lo:hi]
    else:
        q, s = w.weight.index_select(0, experts[lo:hi]), w.scale.index_select(0, experts[lo:hi])
    return w.dequantize_slices(q, s)
