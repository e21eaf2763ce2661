"""What one launch of a step costs, from the tensors it touches: bytes read and written, FLOPs (padded rows
included), scalar ALU instructions beside them and the CTAs that work. Device independent
(tools/roofline/roofline.py turns a cost into time on a device).

Conventions (the test's independent count follows them, tests/tools/test_roofline.py):
- bytes are the distinct bytes of each tensor a launch reads or writes, once per launch: re-reads inside
  one launch (an activation tile read by every N tile, a weight read by two row blocks) are assumed to hit
  L2. A gather reads the rows it gathers, not its table; an in-place scatter writes the rows it scatters;
- FLOPs are the tensor-core (or FMA) work as tiled: padded rows of a tile count (an M tile of 16 over one
  row does 16 rows of work). Elementwise kernels count no FLOPs (their time is their bytes);
- the routed experts' bytes follow uniformly random routing: a row picks k of E experts, so an expert
  is hit with probability 1 - (1 - k/E)^R over R rows, and gets n ~ Binomial(R, k/E) pairs, i.e.
  ceil(n / BLOCK_M) M-blocks, each re-dequantizing its expert's weights (a real router's skew, and a tree's
  related rows, hit fewer experts);
- attention reads each sequence's whole latent prefix once (its tiles run together and share it in L2).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable

import torch

from ddtree.kernels.moe import tiles as moe_tiles
from ddtree.kernels.moe.configs import MoeTileConfig
from ddtree.kernels.weight_formats import BY_KERNEL_ID

LIBRARY_CTAS = 0  # a library kernel (cuBLAS): assumed to choose a grid (split-K) that fills the device
ELEMENTWISE_BLOCK = 512  # elements per CTA of torch's elementwise kernels (128 threads x 4)
WGMMA_M = 64  # a cuBLAS GEMM's M tile on Hopper at small M: rows are padded to it
# INT4 experts: lane-instructions a program issues per weight element it reads (the unpack, the mma and shared
# memory traffic, the loop's control: everything), counted on the SASS of the tile the launch uses
# (kernels/moe/tiles.issue_per_element); a shape the tables lack: this
INT4_ISSUE_OPS = 16.0


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a launch's tensors do not say: the step's shape and the routing model."""

    rows: int  # rows per sequence (1 = AR)
    context: int  # committed tokens per sequence
    batch: int
    top_k: int  # experts per token
    global_experts: int  # E of the model (local experts may be E / N under expert parallelism)


@dataclasses.dataclass(frozen=True)
class Cost:
    bytes_read: float
    bytes_written: float
    flops: float = 0.0
    math: str = "fp32"  # the FLOPs' kind: bf16 / fp16 / fp8 / int4 (tensor cores) or fp32
    alu_ops: float = 0.0  # scalar instructions beside the FLOPs (dequantization)
    ctas: int = 1  # CTAs that do work; LIBRARY_CTAS: the library's own grid

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def dot_kind(dtype) -> str:
    """A Triton dot constexpr (tl.bfloat16, ...) or torch dtype -> a math kind."""
    name = getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")
    return {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32",
            "float8_e4m3fn": "fp8", "fp8e4nv": "fp8"}.get(name, "fp32")  # fmt: skip


def _grid_ctas(grid: tuple) -> int:
    return math.prod(int(g) for g in grid)


# ---- Triton kernels, by function name ---------------------------------------------------------------------
def _rms_norm(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    rows, d = grid[0], a["n_cols"]
    x = rows * d * a["X"].element_size()
    res = rows * d * a["RES"].element_size() if a["HAS_RESIDUAL"] else 0
    out = rows * d * a["OUT"].element_size()
    return Cost(x + res + nbytes(a["W"]), out + res, ctas=rows)


def _rope(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    T, width = grid[0], a["HEADS"] * 2 * a["HALF"]
    return Cost(T * width * a["X"].element_size() + 2 * T * a["HALF"] * 4, T * width * a["OUT"].element_size(), ctas=T)


def _latent_write(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    T, W = grid[0], a["R"] + a["DR"]
    idx = T * (a["SLOTS"].element_size() + a["POS"].element_size())
    read = T * W * a["LATENT"].element_size() + idx + nbytes(a["WEIGHT"]) + nbytes(a["INV_FREQ"])
    return Cost(read, T * W * a["KV"].element_size(), ctas=T)


def _silu_mul(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    n = grid[0] * a["n_cols"]
    return Cost(
        n * (a["GATE"].element_size() + a["UP"].element_size()), n * a["OUT"].element_size(), ctas=_grid_ctas(grid)
    )


def _router(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    M, E, K = a["M"], a["E"], a["K"]
    row_blocks, e_blocks = grid[0], grid[1]
    scores = M * E * 4  # the fp32 scratch: written by the tiles, read back by each row block's selecting program
    parts = nbytes(a["PARTS"])  # K splits' partial logits (split programs only): written, then read by the tile
    out = M * a["TOP_K"] * (a["OUT_W"].element_size() + a["OUT_IDS"].element_size())
    read = M * K * a["X"].element_size() + E * K * a["W"].element_size() + nbytes(a["BIAS"]) + scores + parts
    padded_k = a["N_SPLITS"] * a["K_SPLIT"]  # the last split's columns past K are multiplied too
    flops = 2 * row_blocks * a["BLOCK_M"] * e_blocks * a["BLOCK_E"] * padded_k  # the ieee fp32 dot
    return Cost(read, scores + parts + out, flops, "fp32", ctas=_grid_ctas(grid))


def _mla_split(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    q_lat, q_pe, kv = a["Q_LAT"], a["Q_PE"], a["KV"]
    keys = ctx.context + ctx.rows
    kv_read = ctx.batch * keys * kv.shape[1] * kv.element_size()
    tiles = a["TILES"].numel() // 4  # 4 ints per tile
    block_m, block_r, block_dr = a["BLOCK_M"], a["BLOCK_R"], a["BLOCK_DR"]
    flops = 2 * tiles * block_m * keys * (2 * block_r + block_dr)  # q·c_kv, q_pe·k_pe, p·c_kv
    written = nbytes(a["PART_O"]) + nbytes(a["PART_LSE"]) + (0 if a["PART_O"].numel() else nbytes(a["OUT"]))
    math_kind = "fp32" if a["BF16_VIA_FP32"] else dot_kind(kv.dtype)
    return Cost(nbytes(q_lat) + nbytes(q_pe) + kv_read + nbytes(a["ITEMS"]), written, flops, math_kind, ctas=grid[0])


def _mla_merge(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    return Cost(nbytes(a["PART_O"]) + nbytes(a["PART_LSE"]), nbytes(a["OUT"]), ctas=_grid_ctas(grid))


def expert_blocks(rows: int, top_k: int, experts: int, local: int, block_m: int) -> tuple[float, float]:
    """(expected experts hit, expected M-blocks) of `local` experts over `rows` rows under random routing."""
    p = top_k / experts
    hit = local * (1 - (1 - p) ** rows)
    per_expert = sum(math.comb(rows, n) * p**n * (1 - p) ** (rows - n) * -(-n // block_m) for n in range(1, rows + 1))
    return hit, local * per_expert


def _moe_gemm(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    w1, s1, out = a["W1"], a["S1"], a["OUT"]
    gate_up, kind, N, K, block_m = a["GATE_UP"], a["KIND"], a["N"], a["K"], a["BLOCK_M"]
    local = w1.shape[0]
    pairs = a["num_pairs"]
    tokens = pairs // ctx.top_k
    hit, blocks = expert_blocks(tokens, ctx.top_k, ctx.global_experts, local, block_m)
    per_expert = (nbytes(w1) + (nbytes(s1) if s1 is not w1 else 0)) / local
    mats = 2 if gate_up else 1
    a_rows = tokens if gate_up else pairs  # gate/up reads the tokens' x, down the pairs' h
    read = hit * per_expert * mats + a_rows * K * a["A"].element_size() + nbytes(a["SORTED"]) + nbytes(a["TOPK_W"])
    written = pairs * N * out.element_size()
    flops = 2 * blocks * block_m * N * K * mats
    fmt = BY_KERNEL_ID[kind]
    dequant = blocks * N * K * mats * _int4_issue(a, fmt.name, N, K) if fmt.dequantizes_tiles else 0
    n_tiles = grid[1] if len(grid) > 1 else 1
    math_kind = "fp8" if fmt.quantizes_activations else dot_kind(a["DOT"])  # 8-bit dots on quantized activations
    return Cost(read, written, flops, math_kind, dequant, max(1, round(blocks * n_tiles)))


def _int4_issue(a: dict, kind: str, N: int, K: int) -> float:
    """Issue per weight element of this INT4 launch's tile: the tile tables' SASS count, else INT4_ISSUE_OPS."""
    op = "gate_up" if a["GATE_UP"] else "down"
    key = moe_tiles.shape_key(kind, op, N, K, a["GROUP"])
    cfg = MoeTileConfig(a["BLOCK_M"], a["BLOCK_N"], a["BLOCK_K"], a.get("num_warps", 4), a.get("num_stages", 3))
    counted = moe_tiles.issue_per_element(key, cfg)
    return INT4_ISSUE_OPS if counted is None else counted


def _dense_gemm(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    """kernels/gemm/dense.py (row-invariant, no split-K): one program per (M tile, N tile, batch)."""
    m_tiles, n_tiles = grid[0], grid[1] if len(grid) > 1 else 1
    batch = grid[2] if len(grid) > 2 else 1
    x, w, y = a["X"], a["W"], a["Y"]
    bias = nbytes(a["B"]) if a["HAS_BIAS"] else 0
    flops = 2 * batch * m_tiles * a["BLOCK_M"] * n_tiles * a["BLOCK_N"] * a["K"]
    kind = "fp32" if a["VIA_FP32"] else dot_kind(x.dtype)
    return Cost(nbytes(x) + nbytes(w) + bias, nbytes(y), flops, kind, ctas=_grid_ctas(grid))


def _all_tensors(a: dict, grid: tuple, ctx: StepContext) -> Cost:
    """Any other kernel: every tensor argument read once, nothing written apart (an upper bound for small ones)."""
    seen = {id(t): t for t in a.values() if isinstance(t, torch.Tensor)}
    return Cost(sum(nbytes(t) for t in seen.values()), 0, ctas=_grid_ctas(grid))


TRITON_COSTS: dict[str, Callable[[dict, tuple, StepContext], Cost]] = {
    "_rms_norm_kernel": _rms_norm,
    "_rope_kernel": _rope,
    "_latent_write_kernel": _latent_write,
    "_silu_mul_kernel": _silu_mul,
    "_router_kernel": _router,
    "_mla_split_kernel": _mla_split,
    "_mla_merge_kernel": _mla_merge,
    "_moe_gemm_kernel": _moe_gemm,
    "_dense_gemm_kernel": _dense_gemm,
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid")


def triton_cost(fn, grid, args: tuple, kwargs: dict, ctx: StepContext) -> Cost:
    """The cost of `fn[grid](*args, **kwargs)` (fn: the kernel's Python function)."""
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    kwargs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = {**options, **bound.arguments}  # the launch's num_warps / num_stages too (the INT4 tile's issue count)
    if callable(grid):
        grid = grid(a)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    return TRITON_COSTS.get(fn.__name__, _all_tensors)(a, grid, ctx)
