"""Column-major linear and expert weights for a model served on the CPU.

`nn.Linear` stores its weight [N, K] row-major and computes x @ w.T. For the few rows of a decode or
verify step, the CPU's BLAS (oneDNN / MKL) runs that product faster when w.T is itself row-major, i.e.
when w is stored column-major: `w.t().contiguous().t()`, the same shape [N, K] with strides (1, N).
docs/performance.md has the measurement that keeps this (the demo verifier, AR and DDTree, with and
without it).

Numerics: the same products and sums, possibly blocked in another order, so a row's last bits may differ
from the row-major product's (fp32: a few ulp); tests check that the greedy tokens do not change.

Which weights: every plain `nn.Linear` weight of a float dtype, except the ones another module reads as a
view needing row-major strides (MLA's `kv_b_proj`, viewed [H, dn + dv, r]); and the stacked routed
experts of kind bf16 (`StackedProjection` [E, N, K]), each expert column-major (strides (N·K, 1, N)), so
that the grouped matmul's operand `weight.transpose(1, 2)` is contiguous. Packed (FP8 / INT4) weights are
left as they are (their kernels dequantize). Training keeps row-major weights: safetensors writes
contiguous tensors only, so this is applied by the serving engine after loading, never before saving.
"""

from __future__ import annotations

from torch import nn

from ddtree.models.deepseek_v3.moe_experts import StackedProjection

# Linears whose weight another module reads as a view with row-major strides.
VIEWED_WEIGHTS = ("kv_b_proj",)


def use_column_major_weights(model) -> int:
    """Store every eligible CPU linear and bf16 expert weight column-major, in place; returns how many changed.

    The Parameter objects stay the same (their `.data` is replaced), so anything holding them still sees
    the model's weights; `state_dict()` then returns non-contiguous tensors."""
    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, StackedProjection) and not module.fmt.packed:
            w = module.weight  # [E, N, K]
        elif isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in VIEWED_WEIGHTS:
            w = module.weight  # [N, K]
        else:
            continue
        if w.device.type != "cpu" or not w.dtype.is_floating_point or is_column_major(w):
            continue
        w.data = w.data.transpose(-1, -2).contiguous().transpose(-1, -2)
        changed += 1
    return changed


def is_column_major(weight) -> bool:
    """True when a weight [N, K] (or a stack [E, N, K]) is stored column-major per matrix: strides (1, N)
    (or (N·K, 1, N))."""
    return weight.dim() in (2, 3) and weight.transpose(-1, -2).is_contiguous()
