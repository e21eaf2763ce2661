"""Chooses the fused MoE's tile per device class and weight shape (kernels/moe/tiles.py) on a CPU: a roofline
of each candidate at the shapes the deployments run, then the best candidates compiled ahead of time for the
class (compile_launches.build: registers, spills, shared memory from ptxas, SASS instructions from
cuobjdump), and the best that fits by the model with the compiled kernel's own instruction count.

    python -m scripts.bench.moe_tile_table            # writes kernels/moe/tables/sm_90.json and sm_120.json
    python -m scripts.bench.moe_tile_table --kinds int4   # chooses the INT4 tiles again, keeps the others
    python -m scripts.bench.moe_tile_table --print    # the table's compile metadata, one line a tile

Run it without TRITON_INTERPRET (the kernels must compile). Every figure it writes is modeled.

The model of one grouped GEMM launch (`model_us`), for a scenario's active experts and M-blocks:
- memory: the weight bytes of the active experts over the bandwidth the grid can draw, the lesser of the
  device's and the bytes its resident CTAs keep in flight (num_stages - 1 K tiles each) over the memory
  latency (Little's law: a grid of 64 CTAs with one 4 KB tile each does not stream at HBM speed), times
  the wave quantization when the CTAs exceed the resident slots;
- issue: per SM, the instructions its CTAs issue (4 warp-instructions a cycle an SM: 128 lanes) and the
  tensor cores' work (the block_m rows padded, mma.sync rate), the larger of the two (the tensor pipe runs
  beside issue; the mma instructions' issue slots are in the count). A compiled candidate's instructions are
  its SASS (scripts/bench/sass_counts.py): the K loop's body per K tile plus the code outside it once, per
  warp, times its warps (`issue_per_element`: per weight element of the program); candidates are ranked for
  compiling by PRIOR_ISSUE per element;
- the launch takes the larger of memory and issue.
Residency per SM is the least of registers (64K), shared memory and 32 CTAs, from the compiled kernel.
Row invariance fixes what the search may vary: block_m is 16 for every tile (decode and tree verify fill a
16-row block per expert; one block_m for all M), split K is 1 and the K order is the kernel's one loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import math
import sys

import triton
import triton.language as tl

from ddtree.kernels.moe import fused as fm
from ddtree.kernels.moe import tiles as moe_tiles
from ddtree.kernels.moe.configs import MoeTileConfig, smem_bytes
from ddtree.kernels.shared_memory import SMEM_PER_BLOCK
from ddtree.kernels.weight_formats import weight_format
from scripts.bench.compile_launches import build

BLOCK_M = 16
SPILL_LIMIT = 64  # bytes of stack a chosen tile may use (ptxas spills)
SPILL_PENALTY = 0.02  # a tile that spills is chosen over one that does not only when modeled this much faster


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    name: str
    arch: int
    hbm_gbs: float  # memory bandwidth (datasheet)
    sms: int
    clock_ghz: float
    smem_per_sm: int
    mma_flop_per_clk_sm: int  # bf16 mma.sync (m16n8k16) dense, per SM
    alu_ops_per_clk_sm: int = 128  # 32-bit integer / bf16 ops a cycle an SM issues
    latency_us: float = 0.7  # memory latency under load, for Little's law
    regs_per_sm: int = 65536
    max_ctas_per_sm: int = 32


DEVICES = {
    "sm_90": DeviceModel("H200", 90, 4800.0, 132, 1.98, 228 * 1024, 2048),
    "sm_120": DeviceModel("RTX PRO 6000 Blackwell", 120, 1792.0, 188, 2.6, 100 * 1024, 1024),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str
    op: str
    N: int
    K: int
    group: int = 0  # int4
    block: tuple[int, int] = (0, 0)  # fp8 scale block
    experts: int = 384  # E of the model whose rank runs it (the scenarios' routing)
    topk: int = 8

    @property
    def key(self) -> str:
        return moe_tiles.shape_key(self.kind, self.op, self.N, self.K, self.group, self.block)

    def weight_bytes(self) -> float:
        """One expert's weights this op reads (gate_up: gate and up), scales included."""
        one = weight_format(self.kind).read_bytes(self.N, self.K, self.group, self.block)
        return one * (2 if self.op == "gate_up" else 1)


# Kimi K2.6 INT4 (group 32) and DeepSeek-V3 FP8 (128 x 128 blocks) at TP 8: d 7168, I 2048 / 8
SHAPES = (
    Shape("int4", "gate_up", 256, 7168, group=32),
    Shape("int4", "down", 7168, 256, group=32),
    Shape("fp8", "gate_up", 256, 7168, block=(128, 128), experts=256),
    Shape("fp8", "down", 7168, 256, block=(128, 128), experts=256),
)
ROWS = {"ar": 1, "tree17": 17, "prefill2048": 2048}  # tokens in the call; ar and tree17 choose the tile
# issued instructions (per lane) a weight element costs a candidate before it is compiled: the ranking's guess
# (INT4: about what the two-nibble unpack's tiles count, see docs/performance.md section 12)
PRIOR_ISSUE = {"int4": 5.0, "fp8": 0.0, "bf16": 0.0}
LANES_PER_WARP = 32


def scenario(shape: Shape, rows: int) -> tuple[float, int]:
    """(active experts, M-blocks per active expert) for `rows` tokens routed uniformly at random."""
    pairs = rows * shape.topk
    active = shape.experts * (1 - (1 - 1 / shape.experts) ** pairs)
    return active, math.ceil(pairs / active / BLOCK_M)


def residency(dev: DeviceModel, cfg: MoeTileConfig, registers: int, shared: int) -> int:
    regs = math.ceil(registers * 32 / 256) * 256 * cfg.num_warps  # allocated per warp in 256-register units
    return max(1, min(dev.regs_per_sm // max(regs, 1), dev.smem_per_sm // max(shared, 1), dev.max_ctas_per_sm))


def issue_per_element(shape: Shape, cfg: MoeTileConfig, sass_total: int, sass_loop: int) -> float:
    """Lane-instructions a program issues per weight element it reads: (code outside the K loop once, the
    loop's body per K tile) per warp, times warps and 32 lanes, over block_n x K (x 2 for gate_up)."""
    k_tiles = math.ceil(shape.K / cfg.block_k)
    per_warp = sass_total - sass_loop + k_tiles * sass_loop
    ops = 2 if shape.op == "gate_up" else 1
    return per_warp * cfg.num_warps * LANES_PER_WARP / (cfg.block_n * shape.K * ops)


def model_us(
    dev: DeviceModel, shape: Shape, cfg: MoeTileConfig, registers: int, shared: int, rows: int,
    issue: float | None = None,  # issue_per_element of the compiled tile; None: PRIOR_ISSUE
) -> float:  # fmt: skip
    active, mblocks = scenario(shape, rows)
    ctas = active * mblocks * math.ceil(shape.N / cfg.block_n)
    slots = dev.sms * residency(dev, cfg, registers, shared)
    ops = 2 if shape.op == "gate_up" else 1
    tile_bytes = cfg.block_n * cfg.block_k * shape.weight_bytes() / (shape.N * shape.K)
    k_tiles = math.ceil(shape.K / cfg.block_k)
    inflight = min(ctas, slots) * min(max(1, cfg.num_stages - 1), k_tiles) * tile_bytes
    bandwidth = min(dev.hbm_gbs * 1e3, inflight / dev.latency_us)  # bytes per µs
    waves = math.ceil(ctas / slots)
    memory = active * mblocks * shape.weight_bytes() / bandwidth * (waves * slots / ctas if ctas > slots else 1.0)
    per_cta_elems = cfg.block_n * shape.K * ops
    per_element = PRIOR_ISSUE[shape.kind] if issue is None else issue
    alu = per_cta_elems * per_element / (dev.alu_ops_per_clk_sm * dev.clock_ghz * 1e3)
    eight_bit = weight_format(shape.kind).quantizes_activations  # 8-bit dots
    mma_rate = dev.mma_flop_per_clk_sm * (2 if eight_bit else 1)  # an 8-bit mma: twice bf16's
    mma = 2 * BLOCK_M * per_cta_elems / (mma_rate * dev.clock_ghz * 1e3)
    return max(memory, math.ceil(ctas / dev.sms) * max(alu, mma))


def floor_us(dev: DeviceModel, shape: Shape, rows: int) -> float:
    active, _ = scenario(shape, rows)
    return active * shape.weight_bytes() / (dev.hbm_gbs * 1e3)


def candidates(shape: Shape):
    block_ks = (32, 64, 128) if weight_format(shape.kind).block_scaled else (64, 128, 256)
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), block_ks, (4, 8), (2, 3, 4, 5)):
        if bk <= max(32, triton.next_power_of_2(shape.K)) and not (warps == 8 and bn * BLOCK_M < 1024):
            yield MoeTileConfig(BLOCK_M, bn, bk, warps, stages)


def compile_tile(shape: Shape, cfg: MoeTileConfig, arch: int) -> dict:
    """ptxas' registers, stack (spill) bytes and Triton's shared memory of the grouped GEMM at this tile."""
    bf16 = "*bf16"
    w, s = {"int4": ("*i32", bf16), "fp8": ("*fp8e4nv", "*fp32"), "bf16": (bf16, bf16)}[shape.kind]
    fp32_h = weight_format(shape.kind).quantizes_activations  # fp8: h is fp32 (gate_up's output, down's input)
    h = "*fp32" if fp32_h else bf16
    gate_up = shape.op == "gate_up"
    pointers = dict(A=bf16 if gate_up else h, W1=w, S1=s, W2=w, S2=s, OUT=h if gate_up else "*fp32",
                    SORTED="*i32", BLOCK_EXPERT="*i32", TOPK_W="*fp32")  # fmt: skip
    # PAIRED: INT4 words in the device path's pair order (kernels/quant_formats.py)
    consts = dict(stride_wk=1, ROW_DIV=shape.topk if gate_up else 1, GATE_UP=gate_up, KIND=fm._KIND[shape.kind],
                  GROUP=max(shape.group, 8), SCALE_BN=shape.block[0] or 1, SCALE_BK=shape.block[1] or 1,
                  DOT=tl.bfloat16, PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, EVEN_K=shape.K % cfg.block_k == 0,
                  PAIRED=shape.kind == "int4")  # fmt: skip
    kernel = fm._moe_gemm_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else pointers.get(p, "i32") for p in params}
    # the JIT's specialisation of a launch on real tensors: pointers and the Kimi sizes divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*" or t == "i32"}
    return build(kernel, sig, consts, arch, cfg.num_warps, cfg.num_stages, attrs)


def choose(cls: str, shape: Shape, compiled: int = 16, log=print) -> dict:
    """The table entry of `shape` on `cls`: the `compiled` best candidates by the model (estimated shared
    memory, 128 registers, PRIOR_ISSUE) compiled, and the best of those by the model with their registers,
    shared memory and instruction counts, within the budget and SPILL_LIMIT."""
    dev, budget = DEVICES[cls], SMEM_PER_BLOCK[cls]
    score = lambda c, r, sh, i=None: sum(model_us(dev, shape, c, r, sh, ROWS[s], i) for s in ("ar", "tree17"))  # noqa: E731
    fits = [c for c in candidates(shape) if smem_bytes(c, shape.kind, shape.op) <= budget]
    ranked = sorted(fits, key=lambda c: score(c, 128, smem_bytes(c, shape.kind, shape.op)))[:compiled]
    best = None
    for cfg in ranked:
        meta = compile_tile(shape, cfg, dev.arch)
        ok = meta["stack_bytes"] <= SPILL_LIMIT and meta["shared_bytes"] <= budget
        issue = issue_per_element(shape, cfg, meta["sass_total"], meta["sass_loop"])
        s = score(cfg, meta["registers"], meta["shared_bytes"], issue)
        log(f"  {cls} {shape.key} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: {meta} "
            f"{s:.1f} us{'' if ok else ' (rejected)'}")  # fmt: skip
        s_choice = s * (1 + SPILL_PENALTY * (meta["stack_bytes"] > 0))  # a spill-free tile wins a near tie
        if ok and (best is None or (s_choice, meta["registers"]) < (best[0], best[2]["registers"])):
            best = (s_choice, cfg, meta, issue)
    if best is None:
        raise RuntimeError(f"no candidate of {shape.key} compiles for {cls} within its limits")
    _, cfg, meta, issue = best
    modeled = {s: round(model_us(dev, shape, cfg, meta["registers"], meta["shared_bytes"], r, issue), 2)
               for s, r in ROWS.items()}  # fmt: skip
    floors = {s: round(floor_us(dev, shape, r), 2) for s, r in ROWS.items()}
    return dict(config=dataclasses.asdict(cfg), registers=meta["registers"], spill_bytes=meta["stack_bytes"],
                shared_bytes=meta["shared_bytes"], sass_total=meta["sass_total"], sass_loop=meta["sass_loop"],
                issue_per_element=round(issue, 2), modeled_us=modeled, floor_us=floors)  # fmt: skip


def table(cls: str, kinds: tuple[str, ...] | None = None, log=print) -> dict:
    """The table of `cls`, its tiles of `kinds` (None: all) chosen again, the others kept as committed."""
    dev = DEVICES[cls]
    path = moe_tiles.table_path(cls)
    tiles = json.loads(path.read_text())["tiles"] if kinds is not None and path.exists() else {}
    for shape in SHAPES:
        if kinds is None or shape.kind in kinds:
            tiles[shape.key] = choose(cls, shape, log=log)
    model = dict(dataclasses.asdict(dev), rows=ROWS, prior_issue=PRIOR_ISSUE, block_m=BLOCK_M,
                 spill_limit=SPILL_LIMIT, note="modeled on a CPU (scripts/bench/moe_tile_table.py), not measured; "
                 "entries with issue_per_element were chosen by their SASS counts")  # fmt: skip
    return dict(device_class=cls, triton=triton.__version__, model=model, tiles=tiles)


def shape_of(key: str) -> Shape:
    """The Shape a table key names (moe_tiles.shape_key's inverse)."""
    kind, op, n, k, quant = key.split("/")
    group, block = weight_format(kind).params_of(quant)
    return Shape(kind, op, int(n[1:]), int(k[1:]), group, block)


def check(cls: str) -> list[dict]:
    """Every tile of the committed table of `cls` compiled for it again: key, config and ptxas' figures."""
    body = json.loads(moe_tiles.table_path(cls).read_text())
    return [dict(key=key, config=e["config"], **compile_tile(shape_of(key), MoeTileConfig(**e["config"]),
                                                             DEVICES[cls].arch))
            for key, e in body["tiles"].items()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", default=",".join(moe_tiles.CLASSES), help="device classes (sm_90,sm_120)")
    p.add_argument("--print", action="store_true", help="print the committed tables' metadata; write nothing")
    p.add_argument("--check", action="store_true", help="compile the committed tiles again: JSON rows; write nothing")
    p.add_argument("--kinds", default=None, help="choose only these formats' tiles again (int4,fp8), keep the rest")
    args = p.parse_args(argv)
    for cls in args.classes.split(","):
        if args.check:
            print(json.dumps({cls: check(cls)}))
            continue
        path = moe_tiles.table_path(cls)
        if args.print:
            for key, e in json.loads(path.read_text())["tiles"].items():
                c = e["config"]
                print(f"{cls} {key}: {c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} "
                      f"s{c['num_stages']} regs {e['registers']} spill {e['spill_bytes']} smem {e['shared_bytes']} "
                      f"issue/element {e.get('issue_per_element', '-')} modeled {e['modeled_us']} "
                      f"floor {e['floor_us']}")  # fmt: skip
            continue
        kinds = None if args.kinds is None else tuple(args.kinds.split(","))
        body = table(cls, kinds, log=lambda line: print(line, file=sys.stderr, flush=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
