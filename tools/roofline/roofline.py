"""A step's roofline on a named device: each kernel's floor and modeled time, and the step's.

Per launch (cost: tools/roofline/launch_costs.py; device: tools/roofline/devices.py):
    floor_us   = max(bytes / HBM, FLOPs / peak of its math kind)                  the whole device, no overhead
    modeled_us = NODE_US + max(bytes / (HBM · f), FLOPs / (peak · f), ALU ops / (ALU rate · f))
                 f = the fraction of the device its grid draws (devices.DeviceModel.fill: CTAs / SMs, at most 1)
The step is modeled as CUDA graphs replay it: each launch a graph node costing NODE_US beyond its work,
nothing overlapping (kernels of one stream run one after another), plus the collectives from the
interconnect's latency / bandwidth model (all-reduce: devices.Interconnect.all_reduce_us; an all-gather of
S bytes per rank moves (n - 1) S per rank). The host's work between replays (the step message, the
accept walk) is not in it.
"""

from __future__ import annotations

import collections
import dataclasses

from ddtree.tools.roofline.devices import DeviceModel
from ddtree.tools.roofline.launch_costs import LIBRARY_CTAS, Cost

NODE_US = 1.0  # one kernel node of a replayed graph beyond its work: launch gap, ramp, drain (assumed)


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str  # the kernel (Triton function or aten op)
    site: str  # the module that launched it, layers folded ("layers.mlp.gate")
    cost: Cost


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather
    site: str
    nbytes: int  # this rank's tensor


def launch_us(cost: Cost, dev: DeviceModel) -> tuple[float, float, str]:
    """(floor_us, modeled_us, bound): bound is what sets the modeled time (memory, math, alu, launch)."""
    peak = dev.math_tflops(cost.math) * 1e6  # flops per us
    hbm = dev.hbm_gbps * 1e3  # bytes per us
    floor = max(cost.bytes / hbm, cost.flops / peak)
    f = 1.0 if cost.ctas == LIBRARY_CTAS else dev.fill(cost.ctas)
    terms = {"memory": cost.bytes / (hbm * f), "math": cost.flops / (peak * f),
             "alu": cost.alu_ops / (dev.alu_tops * 1e6 * f)}  # fmt: skip
    bound = max(terms, key=terms.get)
    work = terms[bound]
    return floor, NODE_US + work, bound if work >= NODE_US else "launch"


def collective_us(c: Collective, dev: DeviceModel, ranks: int) -> tuple[float, float]:
    """(floor_us: the bandwidth term alone, modeled_us) of one collective over `ranks` ranks."""
    link = dev.interconnect
    if ranks <= 1:
        return 0.0, 0.0
    moved = c.nbytes * ranks if c.kind == "all_gather" else c.nbytes
    share = (ranks - 1) / ranks * moved * (2 if c.kind == "all_reduce" else 1)
    floor = share / (link.bus_gbps * 1e3)
    return floor, link.latency_us + floor


def kernel_rows(launches: list[Launch], dev: DeviceModel) -> list[dict]:
    """One row per (kernel, site), the costliest first: launches, bytes, flops, CTAs per launch (the most;
    None for a library kernel), floor and modeled time, what bounds it (most of its modeled time)."""
    groups: dict[tuple[str, str], list[Cost]] = collections.defaultdict(list)
    for x in launches:
        groups[x.name, x.site].append(x.cost)
    rows = []
    for (name, site), costs in groups.items():
        times = [launch_us(c, dev) for c in costs]
        bounds = collections.Counter()
        for _, modeled, bound in times:
            bounds[bound] += modeled
        library = all(c.ctas == LIBRARY_CTAS for c in costs)
        rows.append(
            dict(
                name=name,
                site=site,
                launches=len(costs),
                bytes=round(sum(c.bytes for c in costs)),
                bytes_read=round(sum(c.bytes_read for c in costs)),
                flops=round(sum(c.flops for c in costs)),
                alu_ops=round(sum(c.alu_ops for c in costs)),
                math=costs[0].math,
                ctas=None if library else max(c.ctas for c in costs),
                floor_us=round(sum(t[0] for t in times), 3),
                modeled_us=round(sum(t[1] for t in times), 3),
                bound=bounds.most_common(1)[0][0],
            )  # fmt: skip
        )
    return sorted(rows, key=lambda r: -r["modeled_us"])


def collective_rows(collectives: list[Collective], dev: DeviceModel, ranks: int) -> list[dict]:
    groups: dict[tuple[str, str], list[Collective]] = collections.defaultdict(list)
    for c in collectives:
        groups[c.kind, c.site].append(c)
    rows = []
    for (kind, site), cs in groups.items():
        times = [collective_us(c, dev, ranks) for c in cs]
        rows.append(dict(name=kind, site=site, count=len(cs), bytes=sum(c.nbytes for c in cs),
                         floor_us=round(sum(t[0] for t in times), 3), modeled_us=round(sum(t[1] for t in times), 3)))  # fmt: skip
    return sorted(rows, key=lambda r: -r["modeled_us"])


def roofline(launches: list[Launch], collectives: list[Collective], dev: DeviceModel, ranks: int) -> dict:
    """The report's roofline part: kernels, collectives, the step's floor and modeled time."""
    kernels = kernel_rows(launches, dev)
    colls = collective_rows(collectives, dev, ranks)
    kernel_floor = sum(r["floor_us"] for r in kernels)
    kernel_modeled = sum(r["modeled_us"] for r in kernels)
    coll_floor = sum(r["floor_us"] for r in colls)
    coll_modeled = sum(r["modeled_us"] for r in colls)
    return {
        "device_model": dev.name,
        "interconnect": dev.interconnect.name,
        "ranks": ranks,
        "kernels": kernels,
        "collectives": colls,
        "launches_per_step": len(launches),
        "bytes_per_step": round(sum(r["bytes"] for r in kernels)),
        "kernels_floor_ms": round(kernel_floor / 1e3, 4),
        "kernels_modeled_ms": round(kernel_modeled / 1e3, 4),
        "collectives_modeled_ms": round(coll_modeled / 1e3, 4),
        "step_floor_ms": round((kernel_floor + coll_floor) / 1e3, 4),
        "step_modeled_ms": round((kernel_modeled + coll_modeled) / 1e3, 4),
        "node_us": NODE_US,
    }


def format_roofline(r: dict, top: int = 25) -> str:
    from ddtree.tools.bench.output import format_table

    head = (f"modeled on {r['device_model']} ({r['interconnect']}, {r['ranks']} ranks): step floor "
            f"{r['step_floor_ms']:.3f} ms, modeled {r['step_modeled_ms']:.3f} ms (kernels {r['kernels_modeled_ms']:.3f}, "
            f"collectives {r['collectives_modeled_ms']:.3f}); {r['launches_per_step']} launches, "
            f"{r['bytes_per_step'] / 1e9:.3f} GB")  # fmt: skip
    rows = [[k["name"], k["site"], k["launches"], f"{k['bytes'] / 1e6:.2f}", f"{k['flops'] / 1e9:.2f}",
             "lib" if k["ctas"] is None else k["ctas"], f"{k['floor_us']:.1f}", f"{k['modeled_us']:.1f}", k["bound"],
             "" if k.get("measured_us") is None else f"{k['measured_us']:.1f}"] for k in r["kernels"][:top]]  # fmt: skip
    rows += [[c["name"], c["site"], c["count"], f"{c['bytes'] / 1e6:.2f}", "", "", f"{c['floor_us']:.1f}",
              f"{c['modeled_us']:.1f}", "interconnect", ""] for c in r["collectives"]]  # fmt: skip
    cols = ["kernel", "site", "launches", "MB", "GFLOP", "CTAs", "floor us", "modeled us", "bound", "measured us"]
    return "\n".join([head, format_table(cols, rows)])
