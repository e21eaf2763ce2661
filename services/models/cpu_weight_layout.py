"""Column-major linear and expert weights for CPU inference: a measured fixed-cost lever of the small-row step.

`nn.Linear` stores its weight [N, K] row-major, and `F.linear(x, w)` computes x @ w.T. On the CPU, for
the few rows of a decode or verify step (1 to a few dozen), oneDNN / MKL run the product faster when w.T
is itself row-major, i.e. when w is stored column-major: `w.t().contiguous().t()` (same shape [N, K],
strides (1, N)). Measured on an AMX Xeon (2 vCPUs, 1 thread) on the demo target: 1.1-1.9x faster per
linear called alone at 1-17 rows, and the whole forward (`python -m scripts.bench_cpu_layout`) 1.06-1.08x
faster at 1 row and 1.01-1.05x at 17 rows over contexts 128-4096 (the linears are a fraction of a step).

Numerics: the same products and sums, possibly in a different blocking order, so a row's last bits may
differ from the row-major product's (fp32: within a few ulp); the model's argmax, and so every output
token, is checked against the row-major model by the tests (the verifier still decides every token).

Which weights: every plain `nn.Linear` weight of a float dtype on the CPU, except the ones the model views
as something else (MLA's `kv_b_proj`, viewed [H, dn + dv, r] by `mla.w_uk_uv`, which needs row-major
strides); and the stacked routed experts of kind bf16 (moe_experts.py `StackedProjection`, [E, N, K]),
each expert's [N, K] column-major (strides (N·K, 1, N)), so that the grouped matmul's operand
`weight.transpose(1, 2)` [E, K, N] is contiguous: `torch._grouped_mm` at 34 rows over the demo's 4
experts of 256 x 256 was 1.2-1.3x faster that way (1.0x at 2 rows). Packed (FP8 / INT4) projections are
left as they are (their kernels dequantize). Training keeps row-major weights (safetensors writes
contiguous tensors only).
"""

from __future__ import annotations

from torch import nn

from ddtree.config import CPU_LINEAR_LAYOUTS as LAYOUTS

from .moe_experts import StackedProjection

# Linears whose weight another module reads as a view with row-major strides.
VIEWED_WEIGHTS = ("kv_b_proj",)


def resolve_layout(layout: str, device: str) -> str:
    """'row' or 'column' for a setting of `--cpu-linear-layout` on a device (auto = column on the CPU)."""
    if layout not in LAYOUTS:
        raise ValueError(f"cpu_linear_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "auto":
        return "column" if str(device).split(":")[0] == "cpu" else "row"
    return layout


def use_column_major_weights(model: nn.Module) -> int:
    """Store every eligible CPU linear and bf16 expert weight column-major, in place; returns how many changed.

    The parameter object stays the same (its `.data` is replaced), so optimizers and state-dict views built
    before this call still name it; `state_dict()` then returns non-contiguous tensors (call
    `.contiguous()` before saving)."""
    changed = 0
    for name, module in model.named_modules():
        if isinstance(module, StackedProjection) and module.kind == "bf16":
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
