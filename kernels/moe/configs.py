"""Tile configs of the fused MoE kernels (moe/fused.py): a table by GEMM and token count, with a default.

A fused MoE call runs two grouped GEMMs over the same alignment (moe/align.py), so one block_m:
  op "gate_up": N = I (moe_intermediate_size per rank), K = d (hidden size), gate and up in one pass;
  op "down":    N = d, K = I.
A config is looked up by (kind, op, E, N, K) and the bucket of M (tokens in the call):

    kernels/moe/tables/<device name>.json   (written by `python -m scripts.bench.bench_moe_kernels --moe --autotune`)
    {"device": "NVIDIA H200", "triton": "3.9.0",
     "configs": {"int4/gate_up/E384/N256/K7168": {"1": {"block_m": 16, "block_n": 32, ...}, "16": {...}}}}

The bucket nearest to M (by log distance, ties to the larger) of the key's entry wins; a key with no entry,
no table, or a CPU (interpreted) run falls back to default_config. The table is read once per file.
A config that does not fit the device (OutOfResources at launch) is retried smaller (smaller_configs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re
from collections.abc import Iterator

from ddtree.kernels.shared_memory import dot_smem_bytes, fit_config
from ddtree.kernels.weight_formats import FORMATS, weight_format

OPS = ("gate_up", "down")
KINDS = tuple(FORMATS)
M_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
TABLE_DIR = pathlib.Path(__file__).with_name("tables")
_WIDE_SMEM_BUDGET = 160 * 1024  # default_config's cap on its shared memory estimate with fp32 dots


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class MoeTileConfig:
    block_m: int = 16  # rows (token, slot pairs) of one expert per program; the alignment's padding unit
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or not _pow2(v) or not 16 <= v <= 256:
                raise ValueError(f"MoeTileConfig.{name} must be a power of two in [16, 256] (tl.dot), got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MoeTileConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"MoeTileConfig.num_stages must be in [1, 8], got {self.num_stages!r}")

    @classmethod
    def from_dict(cls, d: dict) -> MoeTileConfig:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"MoeTileConfig: unknown fields {sorted(unknown)}")
        return cls(**d)


def smaller_configs(cfg: MoeTileConfig) -> Iterator[MoeTileConfig]:
    """Ever smaller variants of cfg, to retry a launch that ran out of resources: num_stages down by one to
    1, then block_k halved down to 16, then block_n halved down to 16, each step on top of the ones before.

    block_m never changes: the alignment (moe_align) pads each expert's pairs to it. A block_k that divides
    the fp8 scale block still does when halved.
    """
    for stages in range(cfg.num_stages - 1, 0, -1):
        cfg = dataclasses.replace(cfg, num_stages=stages)
        yield cfg
    while cfg.block_k > 16:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        yield cfg
    while cfg.block_n > 16:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
        yield cfg


def table_key(kind: str, op: str, E: int, N: int, K: int) -> str:
    if kind not in KINDS or op not in OPS:
        raise ValueError(f"moe config: kind must be one of {KINDS} and op one of {OPS}, got {kind!r} / {op!r}")
    return f"{kind}/{op}/E{E}/N{N}/K{K}"


def m_bucket(M: int) -> int:
    """The bucket of M: the nearest of M_BUCKETS in log scale (ties to the larger)."""
    m = max(1, M)
    return min(M_BUCKETS, key=lambda b: (abs(math.log2(b) - math.log2(m)), -b))


def smem_bytes(cfg: MoeTileConfig, kind: str, op: str, a_bytes: int = 2) -> int:
    """shared_memory.dot_smem_bytes of the grouped GEMM: the activation tile and the weight tiles (gate_up:
    gate and up) as loaded; INT4 weights dequantized to the dot's width once more. fp8 loads its activations
    as stored (gate_up: x, a_bytes wide; down: h, fp32 whenever down is fp8) and quantizes them to e4m3 in
    registers: one more activation tile, the dot's operand, which Triton 3.9 stages at two bytes an element
    for sm_90's mma.sync (one on sm_120)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    weights = 2 if op == "gate_up" else 1
    fmt = weight_format(kind)
    a = 4 if fmt.quantizes_activations and op == "down" else a_bytes
    loop = [(bm, bk, a)] + [(bk, bn, fmt.tile_bytes)] * weights
    converted = [(bk, bn, a)] * weights if fmt.dequantizes_tiles else [(bm, bk, 2)] if fmt.quantizes_activations else []
    return dot_smem_bytes(cfg.num_stages, bm, loop, converted)


def default_config(
    kind: str, op: str, E: int, N: int, K: int, M: int, topk: int, a_bytes: int = 2, smem_budget: int | None = None
) -> MoeTileConfig:
    """A heuristic for shapes without a table entry; a_bytes: the size of an activation element in the dot
    (4: fp32 dots, whose tiles take twice the shared memory of bf16's; fp8: as loaded, see smem_bytes);
    smem_budget: the device's shared memory per block (shared_memory.device_smem_budget), which the config's
    estimate is shrunk to fit (smaller_configs' order; None: no cap).

    block_m follows the pairs per expert (M·topk/E, the rows an M-block can fill): decode and tree verify
    (a few pairs per expert) use 16, the tl.dot minimum, so padding wastes little compute. With few active
    experts (small M·topk) a narrow block_n gives more programs to fill the SMs (~130 on an H100 / H200);
    the weights are read once either way. Quantized weights are dequantized per K tile, so a long K tile
    amortises the scale loads.
    """
    per_expert = M * topk / max(E, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    active = min(E, M * topk)  # experts with a pair, at most
    programs = lambda bn: active * -(-N // bn)  # noqa: E731  (M-blocks x N-tiles, about)
    block_n = 16 if programs(32) < 128 else 32 if programs(64) < 512 else 64 if block_m < 64 else 128
    block_k = weight_format(kind).moe_block_k
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    num_stages = 3 if block_m <= 32 else 4
    if a_bytes >= 4:
        # An estimate of the pipelined A and W tiles, kept under 160 KiB: headroom under Hopper's 227 KiB
        # per-block (opt-in) limit. Only an estimate: fused_moe's launch fallback is what guarantees a fit.
        per_stage = (block_m * block_k + block_k * block_n) * a_bytes
        num_stages = max(1, min(num_stages, _WIDE_SMEM_BUDGET // per_stage))
    cfg = MoeTileConfig(block_m, block_n, block_k, num_warps, num_stages)
    return fit_config(cfg, smaller_configs, lambda c: smem_bytes(c, kind, op, a_bytes), smem_budget)


def device_table_path(device_name: str) -> pathlib.Path:
    """kernels/moe/tables/<name>.json, the name with anything but letters, digits, '-', '_' as '_'."""
    return TABLE_DIR / (re.sub(r"[^A-Za-z0-9_-]+", "_", device_name).strip("_") + ".json")


@functools.lru_cache(maxsize=8)
def load_table(path: pathlib.Path) -> dict[str, dict[int, MoeTileConfig]]:
    """key -> {M bucket: config}; {} when the file does not exist; ValueError naming the file when malformed."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {
            key: {int(m): MoeTileConfig.from_dict(cfg) for m, cfg in by_m.items()}
            for key, by_m in raw["configs"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"moe config table {path}: {e}") from e


def save_table(path: pathlib.Path, configs: dict[str, dict[int, MoeTileConfig]], device: str, **meta) -> None:
    """Write a table in load_table's format (merging into an existing file's entries)."""
    merged = dict(load_table(path)) if path.is_file() else {}
    for key, by_m in configs.items():
        merged[key] = {**merged.get(key, {}), **by_m}
    body = {
        "device": device,
        **meta,
        "configs": {
            k: {str(m): dataclasses.asdict(c) for m, c in sorted(v.items())} for k, v in sorted(merged.items())
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
    load_table.cache_clear()


def get_config(
    kind: str,
    op: str,
    E: int,
    N: int,
    K: int,
    M: int,
    topk: int,
    device_name: str | None = None,
    a_bytes: int = 2,
    smem_budget: int | None = None,
) -> MoeTileConfig:
    """The table's config for the nearest M bucket (device_name None: no table; a table was tuned on its
    device, so it fits there), else default_config (with a_bytes, the activation element size in the dot,
    and the device's smem_budget)."""
    if device_name:
        by_m = load_table(device_table_path(device_name)).get(table_key(kind, op, E, N, K))
        if by_m:
            m = max(1, M)
            return by_m[min(by_m, key=lambda b: (abs(math.log2(b) - math.log2(m)), -b))]
    return default_config(kind, op, E, N, K, M, topk, a_bytes, smem_budget)
