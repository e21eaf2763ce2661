"""What one aten op of a step costs on the device (tools/roofline/launch_costs.py's conventions): the GEMMs
(mm, addmm, bmm: cuBLAS, rows padded to its M tile), gathers and scatters (the rows they move), copies,
fills, reductions and elementwise ops (each distinct input once, the output written).

`op_cost(name, args, kwargs, out)` is called for an op that launches (op_count.NOT_LAUNCHED excluded).
"""

from __future__ import annotations

import torch

from ddtree.tools.roofline.launch_costs import ELEMENTWISE_BLOCK, LIBRARY_CTAS, WGMMA_M, Cost, dot_kind, nbytes
from ddtree.tools.step_cost.op_count import _tensors

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
GATHERS = frozenset({"embedding", "index", "index_select", "gather", "take"})
SCATTERS = frozenset({"index_put", "index_put_", "_index_put_impl_", "index_copy", "index_copy_", "scatter",
                      "scatter_", "index_add_", "scatter_add_"})  # fmt: skip
FILLS = frozenset({"zeros", "ones", "full", "zero_", "fill_", "zeros_like", "ones_like", "full_like", "arange", "new_zeros",
                   "new_full", "new_ones"})  # fmt: skip


def _padded(m: int) -> int:
    return -(-m // WGMMA_M) * WGMMA_M


def _gemm(name: str, args: tuple, out: torch.Tensor) -> Cost:
    if name in ("addmm", "baddbmm"):
        bias, a, b = args[0], args[1], args[2]
    else:
        bias, a, b = None, args[0], args[1]
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    read = nbytes(a) + nbytes(b) + nbytes(bias)
    return Cost(read, nbytes(out), 2 * batch * _padded(m) * n * k, dot_kind(a.dtype), ctas=LIBRARY_CTAS)


def _elementwise_ctas(out_numel: int) -> int:
    return max(1, -(-out_numel // ELEMENTWISE_BLOCK))


def op_cost(name: str, args: tuple, kwargs: dict, out) -> Cost:
    outs = _tensors(out)
    inputs = _tensors((args, kwargs))
    written = sum(nbytes(t) for t in outs)
    numel = max((t.numel() for t in outs), default=0)
    if name in GEMMS and len(outs) == 1:
        return _gemm(name, args, outs[0])
    if name in GATHERS:
        index = [t for t in inputs if not t.is_floating_point()]
        return Cost(written + sum(nbytes(t) for t in index), written, ctas=_elementwise_ctas(numel))
    if name in SCATTERS:
        moved = [t for t in inputs[1:] if t.is_floating_point()] or inputs[1:]
        index = [t for t in inputs[1:] if not t.is_floating_point()]
        values = sum(nbytes(t) for t in moved)
        return Cost(values + sum(nbytes(t) for t in index), values, ctas=_elementwise_ctas(numel))
    if name in FILLS:
        return Cost(0, written, ctas=_elementwise_ctas(numel))
    if name == "copy_" and len(inputs) >= 2:
        return Cost(nbytes(inputs[1]), nbytes(inputs[0]), ctas=_elementwise_ctas(inputs[0].numel()))
    distinct = {id(t): t for t in inputs}
    read = sum(nbytes(t) for t in distinct.values())
    return Cost(read, written, ctas=_elementwise_ctas(max(numel, max((t.numel() for t in inputs), default=0))))
