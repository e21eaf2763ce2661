"""The fused MoE's committed tile table: one tile per device class and weight shape, whatever the rows.

    kernels/moe/tables/sm_90.json, sm_120.json   (written by `python -m scripts.bench.moe_tile_table`)
    {"device_class": "sm_90", "triton": "3.9.0", "model": {...},
     "tiles": {"int4/gate_up/N256/K7168/g32": {"config": {"block_m": 16, ...}, "registers": 128,
                                               "spill_bytes": 0, "shared_bytes": 32768, "modeled_us": {...},
                                               "issue_per_element": 4.3, ...}}}

A key is the weight format, the op (gate_up: N = I, K = d; down: N = d, K = I, moe/configs.py's ops), the
weight's N and K and its quantization (g<group> for INT4, b<bn>x<bk> for FP8 block scales, "-" for bf16).
The number of rows (M) is deliberately no part of it: a row's result must not depend on how many rows share
the launch (row invariance), so one call's tile is every call's, with one K order (one K loop, no split K)
and a fixed block_m. Both ops of one format and shape class share block_m (the alignment's padding).

The tiles were chosen on a CPU from a roofline of the shapes the deployments run (AR and a 17-row tree of
Kimi K2.6 / DeepSeek-V3 at TP 8) and from each candidate compiled ahead of time for the class (registers,
spills and shared memory from ptxas, instructions from its SASS), see scripts/bench/moe_tile_table.py; the
figures in the files are modeled, not measured. `issue_per_element` (entries chosen since the SASS counts) is
what a program issues per weight element it reads, in lane-instructions: the roofline of a step
(tools/roofline/launch_costs.py) prices the INT4 experts' issue by it. fused_moe uses a table entry when one
matches (CUDA, or a step modeled for a device; not interpreted) and its launch fallback (smaller_configs on
OutOfResources) stays; a shape without an entry gets moe.configs.get_config.
"""

from __future__ import annotations

import functools
import json
import pathlib

from ddtree.kernels.moe.configs import OPS, MoeTileConfig
from ddtree.kernels.weight_formats import FORMATS, weight_format

TABLE_DIR = pathlib.Path(__file__).with_name("tables")
CLASSES = ("sm_90", "sm_120")  # Hopper (H100 / H200); Blackwell workstation (RTX PRO 6000)
KINDS = tuple(FORMATS)


def device_class(capability: tuple[int, int]) -> str | None:
    """The table a device of this compute capability uses: sm_90 for 9.x, sm_120 for 12.x, else None."""
    return {9: "sm_90", 12: "sm_120"}.get(capability[0])


def shape_key(kind: str, op: str, N: int, K: int, group: int = 0, block: tuple[int, int] = (0, 0)) -> str:
    if kind not in KINDS or op not in OPS:
        raise ValueError(f"moe tiles: kind must be one of {KINDS} and op one of {OPS}, got {kind!r} / {op!r}")
    quant = weight_format(kind).params_key(group, block)
    return f"{kind}/{op}/N{N}/K{K}/{quant}"


def table_path(cls: str) -> pathlib.Path:
    if cls not in CLASSES:
        raise ValueError(f"moe tiles: device class must be one of {CLASSES}, got {cls!r}")
    return TABLE_DIR / f"{cls}.json"


@functools.lru_cache(maxsize=4)
def load(cls: str) -> dict[str, MoeTileConfig]:
    """key -> config of the class's table ({} without a file; ValueError naming the file when malformed)."""
    path = table_path(cls)
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if raw["device_class"] != cls:
            raise ValueError(f"holds device class {raw['device_class']!r}")
        return {key: MoeTileConfig.from_dict(entry["config"]) for key, entry in raw["tiles"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"moe tile table {path}: {e}") from e


@functools.lru_cache(maxsize=4)
def _entries(cls: str) -> dict[str, dict]:
    path = table_path(cls)
    return json.loads(path.read_text())["tiles"] if path.is_file() else {}


def issue_per_element(key: str, config: MoeTileConfig) -> float | None:
    """The committed issue_per_element of the entry of this key and tile (the larger where both classes' tables
    have the tile), else the largest of this key's entries; None where no table records one."""
    entries = [e for e in (_entries(cls).get(key) for cls in CLASSES) if e and "issue_per_element" in e]
    same = [e["issue_per_element"] for e in entries if MoeTileConfig.from_dict(e["config"]) == config]
    return max(same or [e["issue_per_element"] for e in entries], default=None)


def _key(w, op: str) -> str:
    return shape_key(w.kind, op, w.out_features, w.in_features, w.group_size, tuple(w.block))


def table_configs(cls: str | None, gate, down) -> tuple[MoeTileConfig, MoeTileConfig] | None:
    """(gate_up, down) tiles of the class's table for these expert weights (ExpertWeights), or None when
    either op has no entry (or the two disagree on block_m, which the table's test rules out)."""
    if cls is None:
        return None
    table = load(cls)
    gu, dn = table.get(_key(gate, "gate_up")), table.get(_key(down, "down"))
    if gu is None or dn is None or gu.block_m != dn.block_m:
        return None
    return gu, dn
