"""Measured time per kernel on a GPU, set against the roofline (`ddtree bench step` on CUDA).

`profile_kernels` runs the step under torch.profiler (CUPTI) and sums each CUDA kernel's time per step by
its name. `attach_measured` is pure: it puts the times on the roofline's rows (roofline.py). A Triton kernel
is named on the GPU by its function (`_router_kernel`), so its rows get `measured_us` (a kernel launched
at several sites has its time shared among them in proportion to their modeled times: the profile does not
say which site ran it) and `pct_of_floor` = floor / measured. cuBLAS, torch's own kernels and NCCL cannot be
told apart by site: they are summed as `other` against the modeled aten rows and collectives.
"""

from __future__ import annotations

import collections
from collections.abc import Callable


def profile_kernels(step: Callable[[], object], repeat: int) -> dict[str, float]:
    """{CUDA kernel name: µs per step} over `repeat` calls of step()."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            totals[e.name] += e.time_range.elapsed_us() / repeat
    return dict(totals)


def _is_triton(name: str) -> bool:
    return name.startswith("_")  # the project's Triton kernels are private functions; aten ops are not


def attach_measured(roofline: dict, times: dict[str, float]) -> dict:
    """The roofline with measured times: per Triton row `measured_us` and `pct_of_floor`, and `measured`:
    {kernels_ms, triton_ms, other_ms, other_modeled_ms} (other: cuBLAS, aten, NCCL)."""
    rows = [dict(r) for r in roofline["kernels"]]
    by_name: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        if _is_triton(r["name"]):
            by_name[r["name"]].append(r)
    matched = 0.0
    for name, group in by_name.items():
        measured = sum(t for kernel, t in times.items() if kernel == name or kernel.startswith(name + "_"))
        matched += measured
        modeled = sum(r["modeled_us"] for r in group) or 1.0
        for r in group:
            r["measured_us"] = round(measured * r["modeled_us"] / modeled, 3)
            r["pct_of_floor"] = round(100 * r["floor_us"] / r["measured_us"], 1) if r["measured_us"] > 0 else None
    total = sum(times.values())
    other_modeled = sum(r["modeled_us"] for r in rows if not _is_triton(r["name"]))
    other_modeled += sum(c["modeled_us"] for c in roofline.get("collectives", []))
    measured = dict(kernels_ms=round(total / 1e3, 4), triton_ms=round(matched / 1e3, 4),
                    other_ms=round((total - matched) / 1e3, 4), other_modeled_ms=round(other_modeled / 1e3, 4))  # fmt: skip
    return {**roofline, "kernels": rows, "measured": measured}
